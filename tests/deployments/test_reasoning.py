"""Reasoning parsers over the served app: a tiny Qwen3-shaped model (q/k norms, <think> and
</think> tokens, a template that honours enable_thinking) whose greedy output is a script.

The script model: every layer's output projections are zero, so each position's hidden
state is its token's embedding and the next token depends on the current one only; the LM
head maps each script token's embedding to the next script token (a chain of distinct
tokens). Its greedy output is the script, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from safetensors.torch import load_file, save_file

from rayserve_paged.config import EngineConfig
from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.models.tiny import EOS, make_tiny_model
from tests.deployments.conftest import asgi_client, idle_client, parse_sse

pytestmark = pytest.mark.anyio

MODEL = "tiny-qwen3-thinking"
THINKING = "The river was quiet"
ANSWER = " It is open"
# Qwen3's template with the tiny model's role tokens: enable_thinking false closes an empty
# reasoning in the prompt, so the output is all content
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]
BOOL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def write_script_model(out: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoTokenizer

    make_tiny_model("llama", out, vocab_size=514, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                    use_sliding_window=False)  # fmt: skip
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.save(str(out / "tokenizer.json"))
    config_path = out / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": TEMPLATE}))
    hf = AutoTokenizer.from_pretrained(str(out))
    script = [hf.convert_tokens_to_ids("<think>"), *hf.encode(THINKING, add_special_tokens=False),
              hf.convert_tokens_to_ids("</think>"), *hf.encode(ANSWER, add_special_tokens=False)]  # fmt: skip
    assert len(set(script)) == len(script), "the script's tokens must be distinct"
    # every prompt's last token (thinking on or off) leads to the script's first
    prompts = [hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kw)
               for kw in ({}, {"enable_thinking": False})]  # fmt: skip
    prompt_ends = {hf(p, add_special_tokens=False).input_ids[-1] for p in prompts}
    assert not prompt_ends & set(script)
    weights = load_file(str(out / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
        elif name.endswith("norm.weight"):
            weights[name].fill_(1.0)
    embed = torch.randn(weights["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(0))
    weights["model.embed_tokens.weight"] = embed
    head = torch.zeros_like(weights["lm_head.weight"])
    chain = [(t, script[0]) for t in prompt_ends] + list(zip(script, script[1:])) + [(script[-1], hf.eos_token_id)]
    for token, following in chain:
        head[following] += embed[token]
    weights["lm_head.weight"] = head
    head_dim = 16
    for i in range(2):
        for norm in ("q_norm", "k_norm"):
            weights[f"model.layers.{i}.self_attn.{norm}.weight"] = torch.ones(head_dim)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert hf.eos_token == EOS
    return out


@pytest.fixture(scope="session")
def thinking_engine(tmp_path_factory) -> LLMEngine:
    path = write_script_model(tmp_path_factory.mktemp("thinking-qwen3"))
    config = EngineConfig(model=str(path), device="cpu", max_model_len=96, num_gpu_blocks_override=32,
                          swap_space_gb=0.01, max_num_seqs=4)  # fmt: skip
    return LLMEngine(config)


@pytest.fixture(params=["qwen3", "deepseek_r1"])
async def thinking_http(request, thinking_engine):
    async with idle_client(thinking_engine) as client:
        app = create_openai_app(client, thinking_engine.tokenizer, MODEL, reasoning_parser=request.param)
        async with asgi_client(app) as http:
            yield http


async def answer(http, **extra) -> tuple[dict, dict]:
    """(the plain choice, the streamed choice assembled: reasoning, content, finish)."""
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 40, **extra}
    plain = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    events = parse_sse(await http.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant" and not deltas[0].get("content")
    streamed = {
        "reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas) or None,
        "content": "".join(d.get("content", "") for d in deltas) or None,
        "finish_reason": events[-1]["choices"][0]["finish_reason"],
    }
    return plain, streamed


async def test_thinking_goes_to_reasoning_content_streamed_and_not(thinking_http):
    plain, streamed = await answer(thinking_http)
    assert plain["message"] == {"role": "assistant", "reasoning_content": THINKING, "content": ANSWER}
    assert streamed == {"reasoning_content": THINKING, "content": ANSWER, "finish_reason": "stop"}
    # cut before </think>: all of it is reasoning
    plain, streamed = await answer(thinking_http, max_tokens=3)
    assert plain["message"]["content"] is None and THINKING.startswith(plain["message"]["reasoning_content"])
    assert streamed["reasoning_content"] == plain["message"]["reasoning_content"] and streamed["content"] is None


async def test_enable_thinking_false_reaches_the_template(thinking_http):
    """The template closes the reasoning in the prompt: the whole output is content."""
    plain, streamed = await answer(thinking_http, chat_template_kwargs={"enable_thinking": False})
    script = f"<think>{THINKING}</think>{ANSWER}"
    assert plain["message"] == {"role": "assistant", "content": script}
    assert streamed == {"reasoning_content": None, "content": script, "finish_reason": "stop"}


async def test_a_json_constraint_starts_after_the_thinking(thinking_http):
    fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOOL}}
    plain, streamed = await answer(thinking_http, response_format=fmt)
    assert plain["message"]["reasoning_content"] == THINKING  # free: the grammar would refuse <think> first
    jsonschema.validate(json.loads(plain["message"]["content"]), BOOL)
    assert plain["finish_reason"] == "stop"
    assert streamed == {"reasoning_content": THINKING, "content": plain["message"]["content"], "finish_reason": "stop"}


async def test_reserved_template_kwargs_are_a_400(thinking_http):
    body = {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}}
    response = await thinking_http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "add_generation_prompt" in response.json()["error"]["message"]


def test_when_a_prompt_has_ended_the_reasoning():
    from rayserve_paged.engine.reasoning import is_thinking

    assert is_thinking("qwen3", "<|assistant|>\n", None)
    assert not is_thinking("qwen3", "<|assistant|>\n<think>\n\n</think>\n\n", None)  # closed in the prompt
    assert is_thinking("qwen3", "<think>a</think>b</s>\n<|assistant|>\n", None)  # an earlier turn's reasoning
    assert not is_thinking("qwen3", "<|assistant|>\n", {"enable_thinking": False})
    assert is_thinking("deepseek_r1", "<|assistant|>\n", {"enable_thinking": False})  # qwen3's switch only
    assert not is_thinking(None, "<|assistant|>\n", None)


async def test_a_reasoning_parser_needs_the_end_token(engine_client, engine):
    with pytest.raises(ValueError, match="</think>"):
        create_openai_app(engine_client, engine.tokenizer, "tiny-opt", reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="reasoning_parser"):
        create_openai_app(engine_client, engine.tokenizer, "tiny-opt", reasoning_parser="o1")
