"""LLM.chat and `rayserve-paged generate --chat`: conversations through the chat template."""

from __future__ import annotations

import json

import pytest

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.cli import main

OPTIONS = {"device": "cpu", "max_model_len": 128, "kv_cache_memory_gb": 0.01, "num_cpu_threads": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_paths):
    return LLM(tiny_paths["llama"], **OPTIONS)


def test_chat_is_generate_on_the_rendered_template(llm):
    tokenizer = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": "Hello"}], [{"role": "user", "content": "paged blocks"}]]
    chats = llm.chat(conversations, GREEDY, use_tqdm=False)
    for conversation, out in zip(conversations, chats):
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert out.prompt_token_ids == ids and ids[0] == tokenizer.bos_token_id and ids[1] != ids[0]  # one BOS
        (plain,) = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    (single,) = llm.chat(conversations[0], GREEDY, use_tqdm=False)  # one conversation, not a list of them
    assert single.outputs[0].token_ids == chats[0].outputs[0].token_ids


def test_chat_without_a_template_is_refused(tiny_paths):
    llm = LLM(tiny_paths["opt"], **OPTIONS)
    llm.get_tokenizer().chat_template = None
    with pytest.raises(ValueError, match="has no chat template; use generate"):
        llm.chat([{"role": "user", "content": "Hello"}])


def test_generate_chat_command_prints_the_question_and_the_answer(tiny_paths, llm, capsys):
    argv = ["generate", "--model", tiny_paths["llama"], "--chat", "--prompt", "Hello", "--max-tokens", "6",
            "--max-model-len", "128", "--kv-cache-memory-gb", "0.01", "--device", "cpu", "--json"]  # fmt: skip
    assert main(argv) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (expected,) = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0.0, max_tokens=6))
    assert record["prompt"] == "Hello"
    assert record["token_ids"] == expected.outputs[0].token_ids and record["text"] == expected.outputs[0].text
