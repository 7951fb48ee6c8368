"""`serve run configs/smollm2.yaml` (what `make run` serves) answers a chat through the official
openai client with a real answer, plain and streamed alike."""

from __future__ import annotations

import pytest

from .test_serve_run import served_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."  # SmolLM2-135M-Instruct greedy, as transformers gives it


@pytest.fixture(scope="module")
def client(ray_cluster, serve_port, tmp_path_factory):
    from openai import OpenAI

    with served_config("smollm2.yaml", ray_cluster, serve_port, tmp_path_factory.mktemp("serve")) as base:
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_smollm2(client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_chat_answer_plain_and_streamed_are_the_same_real_answer(client):
    kwargs = dict(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].message.content == ANSWER
    assert plain.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == plain.choices[0].message.content
    assert sum(1 for p in pieces if p) > 1  # streamed token by token, not in one piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
