"""stream_interval N: a stream sends an event once a choice has N new tokens. The first
token still comes at once, the joined stream still equals the whole answer (n > 1,
logprobs, stop strings, usage), and a finish is never held back."""

from __future__ import annotations

import pytest

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.frontend import EngineFrontend
from tests.deployments.conftest import app_http, idle_client
from tests.deployments.test_streaming import PROMPT, assert_streamed_completion_equals_the_whole_one

pytestmark = pytest.mark.anyio

INTERVAL = 4


@pytest.fixture
async def interval_client(engine):
    async with idle_client(engine, stream_interval=INTERVAL) as client:
        yield client


@pytest.fixture
async def interval_http(interval_client, engine):
    async with app_http(interval_client, engine) as http:
        yield http


async def test_deltas_carry_interval_tokens_and_the_first_comes_alone(interval_client, engine):
    params = SamplingParams(temperature=0, max_tokens=22, ignore_eos=True)
    ids = engine.tokenizer(PROMPT).input_ids
    outs = [out async for out in interval_client.generate_stream(ids, params, "interval")]
    sizes = [len(out.outputs[0].token_ids) for out in outs]
    assert sizes[0] == 1  # the first token is not held for the interval
    assert all(size >= INTERVAL for size in sizes[1:-1]), sizes
    assert 1 <= sizes[-1] and outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert sum(sizes) == 22 and len(outs) <= 1 + -(-21 // INTERVAL)
    whole = await interval_client.generate(ids, params, "whole")
    assert [t for out in outs for t in out.outputs[0].token_ids] == whole.outputs[0].token_ids
    assert "".join(out.outputs[0].text for out in outs) == whole.outputs[0].text


async def test_a_stop_string_ends_the_stream_without_waiting_for_the_interval(interval_client, engine):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = engine.tokenizer(PROMPT).input_ids
    whole = await interval_client.generate(ids, params, "whole")
    stop = whole.outputs[0].text[5:7]  # met after a few tokens
    stopped = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    outs = [out async for out in interval_client.generate_stream(ids, stopped, "stopped")]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert "".join(out.outputs[0].text for out in outs) == whole.outputs[0].text[: whole.outputs[0].text.find(stop)]


async def test_streamed_completion_with_an_interval_equals_the_whole_one(interval_http):
    chunks, whole = await assert_streamed_completion_equals_the_whole_one(interval_http)
    # fewer events than tokens (one event per step would be about one per token per prompt)
    num_tokens = sum(len(c["logprobs"]["tokens"]) for c in whole["choices"])
    assert len(chunks) < num_tokens / 2


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        EngineFrontend(core=None, tokenizer=None, stream_interval=0)


def test_the_app_argument_reaches_the_replica(monkeypatch):
    from pydantic import ValidationError

    from rayserve_paged.app import AppArgs
    from tests.deployments.conftest import record_binds

    assert AppArgs(model="tiny-opt", device="cpu").stream_interval == 1  # vLLM's default: every step
    bound = record_binds(monkeypatch, AppArgs(model="tiny-opt", device="cpu", stream_interval=8))
    assert bound["LLMServer"]["kwargs"]["stream_interval"] == 8
    with pytest.raises(ValidationError, match="stream_interval"):
        AppArgs(model="tiny-opt", device="cpu", stream_interval=0)
