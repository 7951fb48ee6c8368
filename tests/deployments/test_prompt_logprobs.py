"""Prompt logprobs over /v1/completions: OpenAI's legacy `echo` + `logprobs` (+ `max_tokens`
0), as lm-eval's local-completions model asks for them, and vLLM's `prompt_logprobs`; the
values equal HF's float32 log-softmax of the tiny OPT's logits."""

from __future__ import annotations

import pytest
import torch

from rayserve_paged.deployments.serving.logprobs import TokenTexts
from tests.deployments.conftest import MODEL, parse_sse

pytestmark = pytest.mark.anyio

PROMPT = "Hello world, the quick brown fox"
GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf_logprobs(tiny_opt_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_opt_path, dtype=torch.float32).eval()

    def of(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len, vocab]

    return of


async def _post(http, **body) -> dict:
    response = await http.post("/v1/completions", json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("max_tokens", [0, 1])
async def test_echo_logprobs_score_the_prompt_in_the_legacy_shape(http, engine, hf_logprobs, max_tokens):
    ids = engine.tokenizer(PROMPT).input_ids
    body = await _post(http, prompt=PROMPT, echo=True, logprobs=2, max_tokens=max_tokens)
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(ids) + max_tokens == len(logprobs["token_logprobs"])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = hf_logprobs(ids)
    text_of = TokenTexts(engine.tokenizer).text  # a token's text as OpenAI writes it ("bytes:..." for a part of a character)
    texts = [text_of(t) for t in ids]
    assert logprobs["tokens"][: len(ids)] == texts
    for p in range(1, len(ids)):
        assert abs(logprobs["token_logprobs"][p] - expected[p - 1, ids[p]].item()) < 1e-4
        top = logprobs["top_logprobs"][p]
        assert top[texts[p]] == logprobs["token_logprobs"][p] and 2 <= len(top) <= 3
        best = expected[p - 1].topk(2)
        for t, v in zip(best.indices.tolist(), best.values.tolist()):
            assert abs(top[text_of(t)] - v) < 1e-4
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(offsets[i] == offsets[i - 1] + len(logprobs["tokens"][i - 1]) for i in range(1, len(offsets)))
    assert choice["text"].startswith(PROMPT) and (max_tokens or choice["text"] == PROMPT)
    assert body["usage"]["completion_tokens"] == max_tokens and body["usage"]["prompt_tokens"] == len(ids)
    if max_tokens:  # lm-eval reads the generated token's logprob as the last entry: greedy is the top one
        assert logprobs["token_logprobs"][-1] == max(logprobs["top_logprobs"][-1].values())


async def test_vllm_prompt_logprobs_field_and_stream(http, engine, hf_logprobs):
    ids = engine.tokenizer(PROMPT).input_ids
    body = await _post(http, prompt=ids, prompt_logprobs=1, max_tokens=2)
    scores = body["choices"][0]["prompt_logprobs"]
    expected = hf_logprobs(ids)
    assert scores[0] is None and len(scores) == len(ids)
    for p in range(1, len(ids)):
        entry = scores[p][str(ids[p])]
        assert abs(entry["logprob"] - expected[p - 1, ids[p]].item()) < 1e-4
        assert entry["decoded_token"] == TokenTexts(engine.tokenizer).text(ids[p])
    plain = await _post(http, prompt=ids, max_tokens=2)
    assert plain["choices"][0]["prompt_logprobs"] is None
    response = await http.post(
        "/v1/completions", json={**GREEDY, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0, "stream": True}
    )
    assert response.status_code == 200
    events = parse_sse(response)
    streamed = [lp for e in events for c in e["choices"] if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    whole = await _post(http, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    assert streamed == whole["choices"][0]["logprobs"]["token_logprobs"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == PROMPT


@pytest.mark.parametrize(
    "body,field",
    [
        ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 99}, "prompt_logprobs"),
        ({"prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 99, "max_tokens": 0}, "logprobs"),
    ],
)
async def test_bad_prompt_logprobs_bodies_are_400(http, body, field):
    response = await http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, **body})
    assert response.status_code == 400, response.text
    assert field in response.text
