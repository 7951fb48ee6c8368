"""The Python handle path: LLMServer.generate raises SamplingParamsError / RequestError (both
ValueErrors naming the field) for bad input, as the HTTP API answers 400, and goes on serving.

No Ray: LLMServer gets an injected scheduler actor, a real SchedulerActor (in-process
executor, its own step thread) behind a stand-in for the actor handle's `.remote()` calls.
"""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest

from rayserve_paged.core.sequence import SamplingParams, SamplingParamsError
from rayserve_paged.deployments import llm_server
from rayserve_paged.deployments.llm_server import LLMServer
from rayserve_paged.engine.llm_engine import RequestError
from rayserve_paged.engine.scheduler_actor import SchedulerActor
from tests.deployments.conftest import MAX_LOGPROBS, MAX_MODEL_LEN, MAX_NUM_SEQS

pytestmark = pytest.mark.anyio


class _LocalActor:
    """`actor.method.remote(*args)` on a local object, shaped like a Ray actor handle's
    results: a coroutine method gives an awaitable, a streaming generator gives an async
    iterator of awaitables (ObjectRefs), a plain method its value (ray.get is identity here)."""

    def __init__(self, target) -> None:
        self.target = target

    def __getattr__(self, name: str):
        return _LocalMethod(getattr(self.target, name))


class _LocalMethod:
    def __init__(self, method) -> None:
        self.method = method

    def options(self, **_):
        return self

    def remote(self, *args):
        result = self.method(*args)
        if inspect.isasyncgen(result):
            return _refs(result)
        if inspect.iscoroutine(result):
            return asyncio.ensure_future(result)  # runs even if never awaited, like an actor call
        return result


async def _refs(items):
    async for item in items:
        ref = asyncio.get_running_loop().create_future()
        ref.set_result(item)
        yield ref


@pytest.fixture
async def server(engine, monkeypatch):
    monkeypatch.setattr(llm_server, "ray", SimpleNamespace(get=lambda ref: ref))
    actor = SchedulerActor(engine.config, executor="in-process")
    server = LLMServer(engine.config, scheduler_actor=_LocalActor(actor))
    yield server
    await server.frontend.close()
    actor.shutdown()
    assert not actor.engine.has_unfinished_requests()
    assert actor.engine.block_manager.num_free_gpu_blocks() == actor.engine.block_manager.gpu.num_blocks


GREEDY = SamplingParams(max_tokens=4, temperature=0)

# (name, prompt, sampling params, exception type, words in the message)
BAD_HANDLE_CALLS = [
    ("temperature < 0", "Hi", {"temperature": -1.0}, SamplingParamsError, ["temperature", ">= 0"]),
    ("top_p > 1", "Hi", {"top_p": 1.5}, SamplingParamsError, ["top_p", "(0, 1]"]),
    ("best_of < n", "Hi", {"n": 3, "best_of": 2}, SamplingParamsError, ["best_of", ">= n"]),
    ("max_tokens 0", "Hi", {"max_tokens": 0}, SamplingParamsError, ["max_tokens", ">= 1"]),
    ("beam with sampling", "Hi", {"use_beam_search": True, "n": 2, "temperature": 0.8}, SamplingParamsError, ["beam"]),
    ("logprobs over the limit", "Hi", {"logprobs": MAX_LOGPROBS + 1}, SamplingParamsError, ["logprobs", "at most"]),
    ("best_of over max_num_seqs", "Hi", {"n": MAX_NUM_SEQS + 1}, SamplingParamsError, ["best_of", "max_num_seqs"]),
    ("params of a wrong type", "Hi", "greedy", RequestError, ["sampling_params"]),
    ("prompt of a wrong type", 42, GREEDY, RequestError, ["prompt"]),
    ("prompt of mixed items", [1, "a"], GREEDY, RequestError, ["prompt"]),
    ("empty token prompt", [], GREEDY, RequestError, ["prompt", "empty"]),
    ("token outside the vocabulary", [1, 10**6], GREEDY, RequestError, ["prompt_token_ids", "vocabulary"]),
    ("prompt too long", [5] * MAX_MODEL_LEN, GREEDY, RequestError, ["prompt", "max_model_len"]),
]


async def test_bad_handle_calls_raise_named_value_errors(server):
    for name, prompt, params, error_type, words in BAD_HANDLE_CALLS:
        with pytest.raises(error_type) as raised:
            await asyncio.wait_for(server.generate(prompt, params), 30)
        assert isinstance(raised.value, ValueError), name
        assert all(word in str(raised.value) for word in words), (name, str(raised.value))
        # and the server goes on serving
        out = await asyncio.wait_for(server.generate("Hello", GREEDY), 30)
        assert out.finished and len(out.outputs[0].token_ids) == 4, name


async def test_unknown_sampling_field_in_a_dict_is_a_named_error(server):
    with pytest.raises(SamplingParamsError, match="bogus"):
        await server.generate("Hi", {"bogus": 1})
