"""OpenAIBatchRoutes (what a batch job runs for each line) against the HTTP app on the same
bodies: the same error status and body for every refused body, and, once the engine has run
the prepared prompts, the same 200 body but for `id` and `created`. No Ray."""

from __future__ import annotations

import asyncio
import json

import pytest

from rayserve_paged.deployments.serving.batch_routes import OpenAIBatchRoutes
from tests.deployments.conftest import MODEL

pytestmark = pytest.mark.anyio

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi there"}]
REFUSED = [
    (COMPLETIONS, {"prompt": "x", "n": "2"}),  # pydantic: strict types
    (COMPLETIONS, {"prompt": "x", "max_tokens": True}),
    (COMPLETIONS, {"prompt": []}),
    (CHAT, {"messages": [{"role": "bogus", "content": "x"}]}),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}),  # SamplingParams' checks, renamed
    (COMPLETIONS, {"prompt": "x", "temperature": -1}),
    (COMPLETIONS, {"prompt": "x", "logprobs": 99}),
    (COMPLETIONS, {"prompt": [5] * 200}),  # longer than the context
    (COMPLETIONS, {"prompt": "x", "max_tokens": 500}),
    (COMPLETIONS, {"model": "nope", "prompt": "x"}),  # 404
    (CHAT, {"messages": MESSAGES, "tool_choice": "required"}),
    (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema"}}),
]
ANSWERED = [
    (COMPLETIONS, {"prompt": ["one two", "three"], "max_tokens": 5, "logprobs": 2, "n": 2,
                   "best_of": 3, "seed": 1, "temperature": 0.9}),  # fmt: skip
    (COMPLETIONS, {"prompt": [11, 12, 13], "max_tokens": 4, "temperature": 0, "echo": True, "stop": ["a"]}),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}),  # fmt: skip
]


@pytest.fixture
def routes(engine) -> OpenAIBatchRoutes:
    info = {"model": MODEL, "max_model_len": engine.max_model_len, "vocab_size": engine.model_config.vocab_size,
            "max_logprobs": engine.config.max_logprobs}  # fmt: skip
    return OpenAIBatchRoutes(engine.tokenizer, info, MODEL)


async def test_a_refused_body_gets_the_servers_error(routes, http):
    for url, body in REFUSED:
        with pytest.raises(Exception) as raised:
            await routes.prepare(url, body)
        status, error = routes.error(raised.value)
        response = await http.post(url, json=body)
        assert (status, json.loads(error)) == (response.status_code, response.json()), body
    status, error = routes.error((await _refusal(routes, COMPLETIONS, {"prompt": "x", "stream": True})))
    assert status == 400 and json.loads(error)["error"]["param"] == "stream"  # a batch line is answered whole


async def _refusal(routes, url, body) -> Exception:
    try:
        await routes.prepare(url, body)
    except Exception as exc:
        return exc
    raise AssertionError(f"{body} was prepared")


async def test_an_answered_body_is_the_servers(routes, http, engine_client):
    for url, body in ANSWERED:
        plan = await routes.prepare(url, body)
        results = await asyncio.gather(*(
            engine_client.generate(p.token_ids, plan.params, request_id, lora_name=plan.lora_name)
            for p, request_id in zip(plan.prompts, plan.request_ids)
        ))  # fmt: skip
        ours = json.loads(routes.respond(plan, list(results)))
        response = await http.post(url, json=body)
        theirs = response.json()
        assert response.status_code == 200, theirs
        assert ours["id"].split("-")[0] == theirs["id"].split("-")[0]
        for key in ("id", "created"):
            ours.pop(key), theirs.pop(key)
        assert ours == theirs, body
