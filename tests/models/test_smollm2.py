"""The embedded SmolLM2-135M-Instruct GGUF through the project against transformers' own GGUF
loader, both in float32 (`quantization="none"`): config, tokenizer, logits, and greedy chat
answers; and the quantized path (`quantization="auto"`) against both.

Each model is loaded once for the module (the 135M model costs seconds, not milliseconds).
"""

from __future__ import annotations

import pytest
import torch

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.llm import LLM
from rayserve_paged.models import quant
from rayserve_paged.models.loader import get_model_config, load_model, load_tokenizer
from rayserve_paged.models.tiny import resolve_model

from .conftest import hf_logits
from .paged import PagedRunner

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gguf_file():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def hf(gguf_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def chat_ids(hf):
    """Token ids of each question rendered by transformers' tokenizer and chat template."""
    _, tokenizer = hf
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
        for q in QUESTIONS
    ]


def test_resolves_to_the_packaged_file(gguf_file):
    assert gguf_file.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_file.is_file()


def test_config_equals_transformers(gguf_file, hf):
    ours, ref = get_model_config(gguf_file), hf[0].config
    assert ours.architecture == "LlamaForCausalLM"
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.hidden_size) == (
        ref.num_hidden_layers,
        ref.num_attention_heads,
        ref.num_key_value_heads,
        ref.head_dim,
        ref.hidden_size,
    )
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (30, 9, 3, 64)
    assert ours.vocab_size == ref.vocab_size == 49152
    assert ours.max_model_len == ref.max_position_embeddings
    assert ours.eos_token_ids == (ref.eos_token_id,) and ours.bos_token_id == ref.bos_token_id
    assert ours.pad_token_id == ref.pad_token_id


def test_tokenizer_and_chat_template_equal_transformers(hf, chat_ids):
    _, ref = hf
    ours = load_tokenizer("smollm2")
    texts = ["Hello, world!", "  leading spaces and\ttabs\n", "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert ours(text).input_ids == ref(text).input_ids, text
    assert ours.chat_template == ref.chat_template
    assert (ours.eos_token, ours.bos_token) == (ref.eos_token, ref.bos_token) == ("<|im_end|>", "<|im_start|>")
    for question, ids in zip(QUESTIONS, chat_ids):
        text = ours.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
        assert ours(text, add_special_tokens=False).input_ids == ids


def test_logits_close_to_transformers(gguf_file, hf, chat_ids):
    """Every position of a packed prefill of two chat prompts; proves the q/k unpermute."""
    config = get_model_config(gguf_file)
    model = load_model(gguf_file, dtype=torch.float32, quantization="none")
    runner = PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_dim, num_blocks=64, block_size=16)
    prompts = chat_ids[:2]
    ours = runner.step(list(enumerate(prompts)), all_logits=True)  # [sum(len), vocab]
    ref = torch.cat([hf_logits(hf[0], p) for p in prompts])
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def _llm(quantization: str) -> LLM:
    return LLM(
        "smollm2", device="cpu", dtype="float32", quantization=quantization, max_model_len=256,
        kv_cache_memory_gb=0.02, swap_space_gb=0.01, num_cpu_threads=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def float_llm():
    return _llm("none")


@pytest.fixture(scope="module")
def quantized_llm():
    return _llm("auto")


def test_greedy_chat_answers_equal_transformers(hf, chat_ids, float_llm):
    """LLM("smollm2").chat greedy == transformers' generate on the same ids, token for token."""
    model, tokenizer = hf
    llm = float_llm
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for out, ids in zip(outputs, chat_ids):
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id
            )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref
    assert outputs[0].outputs[0].text == "The capital of France is Paris."


def test_constrained_chat_answers_are_valid(float_llm):
    """A trained model under each kind of constraint, greedy: every answer parses and
    validates, and ends because the constraint is complete."""
    import json
    import re

    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "facts": {"type": "array", "items": {"enum": ["old", "big", "coastal"]}, "maxItems": 2},
            "location": {"type": "object", "properties": {"north": {"type": "boolean"}}, "required": ["north"],
                         "additionalProperties": False},
        },
        "required": ["city", "country", "facts", "location"],
        "additionalProperties": False,
    }  # fmt: skip
    cases = [
        ({"json": schema}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
        ({"regex": r"[0-9]{1,2} (apples|pears)"}, lambda t: re.fullmatch(r"[0-9]{1,2} (apples|pears)", t)),
        ({"choice": ["Paris", "London", "Rome"]}, lambda t: t in ("Paris", "London", "Rome")),
        ({"grammar": 'start: "Answer: " ("yes" | "no") "."'}, lambda t: t in ("Answer: yes.", "Answer: no.")),
    ]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    for constraint, valid in cases:
        params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=constraint)
        (out,) = float_llm.chat(question, params, use_tqdm=False)
        choice = out.outputs[0]
        assert valid(choice.text) and choice.finish_reason == "stop", (constraint, choice.text)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}]  # fmt: skip
    (out,) = float_llm.chat([{"role": "user", "content": "Weather in Oslo?"}], SamplingParams(temperature=0.0, max_tokens=32),
                      use_tqdm=False, tools=tools, tool_choice="required")  # fmt: skip
    (call,) = out.outputs[0].tool_calls
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)


# The README's greedy examples: (chat message or raw prompt, max_tokens, the README's text).
README_CHATS = [
    ("What is the capital of France?", 32, "The capital of France is Paris."),
    ("Write a haiku about the sea.", 48, "The waves of the sea, a silent beauty,\nA gentle lapping of the shore,\n"
     "A reminder of the beauty that lies beneath,\nA reminder of the ocean's power."),
    ("Name three colors.", 48, "1. Red\n2. Blue\n3. Green"),
    ("Say hello in French.", 16, None),  # the README shows its stream's first events: "Bon", "jour"
]  # fmt: skip
README_PROMPTS = [
    ("The three primary colors are", 16, " the primary colors of the RGB color model: red, blue, and green."),
    ("The capital of France is", 16, " Paris.\n\nThe answer is: 2018-01"),
]


def _readme_outputs(llm: LLM) -> list:
    chats = [
        llm.chat([{"role": "user", "content": q}], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)[0]
        for q, n, _ in README_CHATS
    ]
    prompts = [
        llm.generate(p, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)[0] for p, n, _ in README_PROMPTS
    ]
    return [out.outputs[0] for out in chats + prompts]


def test_quantized_path_keeps_the_readme_answers(float_llm, quantized_llm):
    """quantization auto (Q4_1 / Q8_0 kept packed, this machine's kernel plan) gives the README's
    greedy answers, token for token the float32 path's."""
    fast, ref = _readme_outputs(quantized_llm), _readme_outputs(float_llm)
    for got, want, (_, _, text) in zip(fast, ref, README_CHATS + README_PROMPTS, strict=True):
        assert got.token_ids == want.token_ids
        if text is not None:
            assert got.text == want.text == text
    assert fast[3].text.startswith("Bonjour")
    model = quantized_llm.engine.executor.worker.runner.model
    gate_up, plan = model.model.layers[0].mlp.gate_up_proj, quant.cpu_kernel_plan()
    if plan.is_compiled:  # codes only: no dense copy, the tied head multiplies by the 8-bit embedding
        assert gate_up.packed_weight.bits == 4 and gate_up.dense_weight is None
        assert model.model.embed_tokens.packed_weight.bits == 8 and model.model.embed_tokens.dense_weight is None
    elif plan.is_packed:
        assert gate_up.int4_planes


def test_quantized_logits_close_to_transformers(gguf_file, hf, chat_ids):
    """The quantized path's logits over a packed prefill of two chat prompts, against
    transformers' float32 GGUF load: within 1e-3 on the compiled float32 kernel, 2.5% of the
    largest logit (RMS 0.5%) on torch's packed bfloat16 kernels; same argmax at every position."""
    config = get_model_config(gguf_file)
    model = load_model(gguf_file, dtype=torch.float32)
    runner = PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_dim, num_blocks=64, block_size=16)
    prompts = chat_ids[:2]
    ours = runner.step(list(enumerate(prompts)), all_logits=True)  # [sum(len), vocab]
    ref = torch.cat([hf_logits(hf[0], p) for p in prompts])
    if quant.cpu_kernel_plan().is_compiled:  # float32 throughout; measured: max 1.1e-4, RMS 1.9e-5
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    else:  # bfloat16 activations; measured: max 0.62, RMS 0.12 for logits up to 39.6
        torch.testing.assert_close(ours, ref, atol=0.025 * ref.abs().max().item(), rtol=0)
        assert (ours - ref).pow(2).mean().sqrt() <= 0.005 * ref.abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
