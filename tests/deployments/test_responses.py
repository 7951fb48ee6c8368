"""POST /v1/responses, its typed stream and its store, with the official openai client over
the tiny model (random weights: only constraints make outputs meaningful)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from rayserve_paged.deployments.openai_ingress import ROUTING_SESSION, create_openai_app, routing_session
from rayserve_paged.deployments.serving.response_store import ResponseStore, ResponseStoreConfig, StoredResponse
from rayserve_paged.deployments.serving.responses import OutputItems
from rayserve_paged.engine.frontend import EngineUnavailable
from tests.deployments.conftest import MAX_MODEL_LEN, MODEL, asgi_client, assert_openai_error
from tests.deployments.test_limits import _assert_overloaded, _GatedClient

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": TIME, "strict": True},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
# short calls: the tiny model makes two of them under tool_choice "required"
PARALLEL_TOOLS = [{"type": "function", "name": name, "parameters": NO_ARGUMENTS} for name in ("ping", "pong")]
BASE = {"model": MODEL, "max_output_tokens": 6, "temperature": 0}


class City(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


async def _openai_client(app):
    async with asgi_client(app) as transport:
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=transport,
                                      max_retries=0) as c:  # fmt: skip
            yield c


@pytest.fixture
async def client(app):
    async for c in _openai_client(app):
        yield c


@pytest.fixture
async def hermes_client(hermes_app):
    """A deployment with a tool_call_parser: tool_choice "auto" (the default with tools) is
    parsed there and refused without one, as vLLM's server does."""
    async for c in _openai_client(hermes_app):
        yield c


def _without_ids(response: dict) -> dict:
    """A response with what differs between two runs of one request left out."""
    body = {k: v for k, v in response.items() if k not in ("id", "created_at")}
    body["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    for item in body["output"]:  # the stream helper's ParsedResponse adds `parsed` to each text part
        item["content"] = [{k: v for k, v in part.items() if k != "parsed"} for part in item.get("content", [])]
    return body


def _events(response: httpx.Response) -> list[dict]:
    """The typed events of a Responses stream: each `event:` line names its data's type."""
    assert response.status_code == 200, response.text
    events = []
    for block in response.text.split("\n\n"):
        if block:
            name, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            events.append(event)
    return events


def _check_stream(events: list[dict]) -> dict:
    """Order and numbering of a stream's events; the deltas join to what each item's done
    events carry. Returns the final response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    pieces: dict[int, list[str]] = {}
    order = []
    for event in events[2:-1]:
        index = event["output_index"]
        kind = event["type"].removeprefix("response.")
        order.append((index, kind))
        if kind.endswith(".delta"):
            pieces.setdefault(index, []).append(event["delta"])
        if kind in ("output_text.done", "function_call_arguments.done"):
            done = event.get("text", event.get("arguments"))
            assert "".join(pieces.get(index, [])) == done
        if kind == "output_item.done":
            assert event["item"] == final["output"][index]
    for index, item in enumerate(final["output"]):
        kinds = [k for i, k in order if i == index]
        if item["type"] == "message":
            middle = ["output_text.delta"] * len(pieces.get(index, []))
            expected = ["output_item.added", "content_part.added", *middle, "output_text.done", "content_part.done",
                        "output_item.done"]  # fmt: skip
        else:
            middle = ["function_call_arguments.delta"] * len(pieces.get(index, []))
            expected = ["output_item.added", *middle, "function_call_arguments.done", "output_item.done"]
        assert kinds == expected, kinds
    assert [i for i, _ in order] == sorted(i for i, _ in order)  # one item after the other
    return final


async def test_create_and_stream_give_the_same_response(http, client):
    body = {**BASE, "input": "Hello there", "instructions": "Be brief.", "metadata": {"k": "v"}, "user": "u1"}
    plain = (await http.post("/v1/responses", json=body)).json()
    assert plain["id"].startswith("resp_") and plain["object"] == "response"
    assert plain["status"] == "incomplete" and plain["incomplete_details"] == {"reason": "max_output_tokens"}
    (message,) = plain["output"]
    assert message["type"] == "message" and message["id"].startswith("msg_") and message["role"] == "assistant"
    assert message["content"][0]["type"] == "output_text" and message["content"][0]["text"]
    usage = plain["usage"]
    assert usage["output_tokens"] == 6 and usage["total_tokens"] == usage["input_tokens"] + 6
    assert (plain["instructions"], plain["metadata"], plain["user"]) == ("Be brief.", {"k": "v"}, "u1")
    events = _events(await http.post("/v1/responses", json={**body, "stream": True}))
    final = _check_stream(events)
    assert _without_ids(final) == _without_ids(plain)
    assert sum(e["type"] == "response.output_text.delta" for e in events) > 1  # token by token, not at the end
    assert (await http.get(f"/v1/responses/{final['id']}")).json() == final  # stored once the stream ended
    # the openai client: output_text, and the stream helper's final response (of a completed one)
    response = await client.responses.create(**body)
    assert response.output_text == message["content"][0]["text"]
    body["text"] = {"format": {"type": "json_schema", "name": "city", "schema": City.model_json_schema()}}
    body["max_output_tokens"] = 40
    response = await client.responses.create(**body)
    assert response.status == "completed"
    async with client.responses.stream(**body) as stream:
        texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        streamed = await stream.get_final_response()
    assert "".join(texts) == streamed.output_text == response.output_text
    assert _without_ids(streamed.model_dump(mode="json")) == _without_ids(response.model_dump(mode="json"))


async def test_function_call_and_its_output_round_trip(hermes_client):
    client = hermes_client
    first = await client.responses.create(**{**BASE, "max_output_tokens": 60}, input="Weather in Paris?",
                                          tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    async with client.responses.stream(**{**BASE, "max_output_tokens": 60}, input="Weather in Paris?", tools=TOOLS,
                                       tool_choice={"type": "function", "name": "get_weather"}) as stream:  # fmt: skip
        done = [e.arguments async for e in stream if e.type == "response.function_call_arguments.done"]
        streamed = await stream.get_final_response()
    assert done == [call.arguments] and [(c.name, c.arguments) for c in streamed.output] == [(call.name, call.arguments)]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    answer = {**BASE, "text": {"format": {"type": "json_schema", "name": "city", "schema": City.model_json_schema()}},
              "max_output_tokens": 40}  # fmt: skip
    # the whole conversation sent again, and the same continued from the store
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), result]
    sent = await client.responses.create(input=items, tools=TOOLS, **answer)
    continued = await client.responses.create(input=[result], previous_response_id=first.id, tools=TOOLS, **answer)
    assert sent.usage.input_tokens == continued.usage.input_tokens > first.usage.input_tokens
    assert sent.output_text == continued.output_text
    City.model_validate_json(continued.output_text)
    assert continued.previous_response_id == first.id


async def test_parse_with_a_pydantic_model(client):
    for seed in (1, 2):
        parsed = await client.responses.parse(model=MODEL, input="A sunny city?", text_format=City,
                                              max_output_tokens=40, temperature=1.0, extra_body={"seed": seed})  # fmt: skip
        assert isinstance(parsed.output_parsed, City) and parsed.status == "completed"


async def test_streamed_calls_one_and_parallel(http):
    named = {**BASE, "input": "Weather?", "tools": TOOLS, "max_output_tokens": 60,
             "tool_choice": {"type": "function", "name": "get_weather"}}  # fmt: skip
    body = {**BASE, "input": "Go", "tools": PARALLEL_TOOLS, "tool_choice": "required", "max_output_tokens": 100,
            "temperature": 1.0, "seed": 7}  # fmt: skip
    for request, num_calls in ((named, 1), (body, 2)):
        plain = (await http.post("/v1/responses", json=request)).json()
        final = _check_stream(_events(await http.post("/v1/responses", json={**request, "stream": True})))
        assert _without_ids(final) == _without_ids(plain)
        assert [item["type"] for item in final["output"]] == ["function_call"] * num_calls
        assert len({item["call_id"] for item in final["output"]}) == num_calls
        for item in final["output"]:
            jsonschema.validate(json.loads(item["arguments"]), SCHEMAS.get(item["name"], NO_ARGUMENTS))
    # named: the arguments stream as they grow, in several deltas
    events = _events(await http.post("/v1/responses", json={**named, "stream": True}))
    assert sum(e["type"] == "response.function_call_arguments.delta" for e in events) > 1
    # parallel_tool_calls false: one call
    one = (await http.post("/v1/responses", json={**body, "parallel_tool_calls": False})).json()
    assert [item["type"] for item in one["output"]] == ["function_call"]


async def test_store_get_delete_input_items_and_store_false(http):
    items = [{"role": "user", "content": "one"}, {"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "two"}]}]  # fmt: skip
    first = (await http.post("/v1/responses", json={**BASE, "input": items})).json()
    assert (await http.get(f"/v1/responses/{first['id']}")).json() == first
    listed = (await http.get(f"/v1/responses/{first['id']}/input_items", params={"order": "asc"})).json()
    assert [item["content"][0]["text"] for item in listed["data"]] == ["one", "two"]
    assert listed["first_id"] == listed["data"][0]["id"] and listed["has_more"] is False
    page = (await http.get(f"/v1/responses/{first['id']}/input_items", params={"limit": 1})).json()
    assert [item["content"][0]["text"] for item in page["data"]] == ["two"] and page["has_more"] is True
    # a continuation renders the earlier turn: more input tokens than its own items alone
    alone = (await http.post("/v1/responses", json={**BASE, "input": "three", "store": False})).json()
    second = (await http.post("/v1/responses", json={**BASE, "input": "three",
                                                     "previous_response_id": first["id"]})).json()  # fmt: skip
    assert second["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + first["usage"]["input_tokens"] - 4
    listed = (await http.get(f"/v1/responses/{second['id']}/input_items")).json()
    assert [item["content"][0]["text"] for item in listed["data"]] == ["three"]  # its own input only
    # store: false keeps nothing; deleted and unknown ids are 404s
    assert_openai_error(await http.get(f"/v1/responses/{alone['id']}"), 404, None, "store: false")
    deleted = await http.delete(f"/v1/responses/{first['id']}")
    assert deleted.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
    for response in (await http.get(f"/v1/responses/{first['id']}"), await http.delete(f"/v1/responses/{first['id']}"),
                     await http.get("/v1/responses/resp_nope/input_items")):  # fmt: skip
        assert_openai_error(response, 404, None, "is stored on this replica")
    missing = await http.post("/v1/responses", json={**BASE, "input": "x", "previous_response_id": first["id"]})
    assert_openai_error(missing, 404, "previous_response_id", first["id"])


async def test_truncation_disabled_is_a_400_auto_drops_the_oldest(http):
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 6} for i in range(11)]
    body = {**BASE, "input": turns, "instructions": "Hi.", "max_output_tokens": 4}
    assert_openai_error(await http.post("/v1/responses", json=body), 400, "input", "maximum context length")
    cut = (await http.post("/v1/responses", json={**body, "truncation": "auto"})).json()
    assert cut["status"] == "incomplete" and cut["truncation"] == "auto"
    assert MAX_MODEL_LEN - 4 - 30 < cut["usage"]["input_tokens"] <= MAX_MODEL_LEN - 4  # as many as fit
    kept = (await http.get(f"/v1/responses/{cut['id']}/input_items", params={"order": "asc", "limit": 100})).json()
    assert [item["content"][0]["text"] for item in kept["data"]] == [t["content"] for t in turns[-len(kept["data"]):]]
    assert 1 <= len(kept["data"]) < len(turns)
    too_long = {**body, "input": "word " * 300, "truncation": "auto"}  # one item, itself too long
    assert_openai_error(await http.post("/v1/responses", json=too_long), 400, "input")


BAD = [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": ["text"]}, "input"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 1000}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"background": True}, "background"),
    ({"stop": ["s"] * 17}, "stop"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
async def test_bad_fields_are_400s_naming_the_param(http, extra, param):
    for stream in (False, True):
        body = {**BASE, "input": "x", "stream": stream, **extra}
        assert_openai_error(await http.post("/v1/responses", json=body), 400, param)


async def test_a_lone_surrogate_anywhere_is_a_400(http):
    for extra in ({"input": "\ud800"}, {"instructions": "\udfff"},
                  {"input": [{"type": "function_call_output", "call_id": "c", "output": "\ud800"}]},
                  {"input": [{"role": "user", "content": [{"type": "input_text", "text": "\ud800"}]}]},
                  {"tools": [{"type": "function", "name": "\ud800"}]}):  # fmt: skip
        content = json.dumps({**BASE, "input": "x", **extra})  # ASCII: the surrogate travels as an escape
        response = await http.post("/v1/responses", content=content, headers={"content-type": "application/json"})
        assert_openai_error(response, 400, None, "lone surrogate")


_TEXT = st.text(max_size=8)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=6)  # fmt: skip
_PART = st.fixed_dictionaries({}, optional={"type": st.sampled_from(["input_text", "output_text", "refusal", "x"]) | _JSON,
                                            "text": _TEXT | _JSON, "refusal": _JSON})  # fmt: skip
_ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference"]) | _JSON,
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | _JSON,
    "content": _TEXT | st.lists(_PART, max_size=2) | _JSON,
    "call_id": _TEXT | _JSON, "name": _TEXT | _JSON, "arguments": _TEXT | _JSON,
    "output": _TEXT | st.lists(_PART, max_size=2) | _JSON, "id": _TEXT | _JSON, "summary": _JSON,
})  # fmt: skip


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(items=st.lists(_ITEM | _JSON, max_size=3) | _JSON, tools=st.none() | st.lists(_JSON, max_size=2),
       tool_choice=st.none() | _JSON)  # fmt: skip
async def test_fuzzed_items_are_never_a_5xx(engine_client, engine, items, tools, tool_choice):
    app = create_openai_app(engine_client, engine.tokenizer, MODEL)
    body = {"model": MODEL, "input": items, "tools": tools, "tool_choice": tool_choice, "max_output_tokens": 1}
    async with asgi_client(app) as http:
        response = await http.post("/v1/responses", json=body)
    assert response.status_code in (200, 400, 404), response.text


def _entry(num_bytes: int, conversation: str = "c") -> StoredResponse:
    return StoredResponse(b"x" * num_bytes, b"[]", 0, conversation)


def test_store_bounds_count_bytes_lru_and_ttl():
    now = [0.0]
    overhead = _entry(0).num_bytes
    store = ResponseStore(ResponseStoreConfig(max_responses=3, max_bytes=3 * overhead + 100, ttl_s=10), lambda: now[0])
    for name in "abc":
        assert store.put(name, _entry(10))
    assert store.get("a") is not None  # a is now the most recently used: b goes first
    store.put("d", _entry(10))
    assert [n for n in "abcd" if store.get(n) is not None] == ["a", "c", "d"] and store.num_evicted == 1
    store.put("e", _entry(90))  # past the byte bound: the least recently used go until it fits
    assert len(store) == 2 and store.num_bytes <= store.config.max_bytes and store.get("e") is not None
    assert not store.put("huge", _entry(4 * overhead))  # larger than the whole store: not kept
    assert store.get("huge") is None
    now[0] = 5.0
    store.get("e")
    now[0] = 12.0  # 12 s after d's last use, 7 s after e's
    assert store.get("d") is None and store.get("e") is not None
    assert store.delete("e") and not store.delete("e") and store.num_bytes == 0 and len(store) == 0
    assert not ResponseStore(ResponseStoreConfig(max_responses=0)).put("a", _entry(1))


async def test_the_store_evicts_by_count_over_http(engine_client, engine):
    app = create_openai_app(engine_client, engine.tokenizer, MODEL, responses_store={"max_responses": 2})
    async with asgi_client(app) as http:
        ids = [(await http.post("/v1/responses", json={**BASE, "input": f"q{i}"})).json()["id"] for i in range(3)]
        assert_openai_error(await http.get(f"/v1/responses/{ids[0]}"), 404, None, "at most 2 responses")
        for response_id in ids[1:]:
            assert (await http.get(f"/v1/responses/{response_id}")).status_code == 200


async def test_a_continuation_keeps_its_conversation_as_the_routing_session(engine_client, engine):
    sessions = []

    class Recording(_GatedClient):
        async def generate(self, prompt, sampling_params, request_id):
            sessions.append(ROUTING_SESSION.get())
            return await self.inner.generate(prompt, sampling_params, request_id)

    client = Recording(engine_client)
    client.gate.set()
    app = create_openai_app(client, engine.tokenizer, MODEL)
    async with asgi_client(app) as http:
        first = (await http.post("/v1/responses", json={**BASE, "input": "a"})).json()
        second = (await http.post("/v1/responses", json={**BASE, "input": "b", "previous_response_id": first["id"]}))
        await http.post("/v1/responses", json={**BASE, "input": "c", "previous_response_id": second.json()["id"]})
        await http.post("/v1/responses", json={**BASE, "input": "d", "user": "alice"})
    root = routing_session(first["id"], None)
    assert sessions == [None, root, root, routing_session("alice", None)]


async def test_limits_and_key_as_on_chat(engine_client, engine):
    client = _GatedClient(engine_client)
    app = create_openai_app(client, engine.tokenizer, MODEL, api_key="k", max_pending_requests=1,
                            max_request_body_bytes=2000)  # fmt: skip
    async with asgi_client(app, headers={"authorization": "Bearer k"}) as http:
        async with asgi_client(app) as anonymous:
            assert_openai_error(await anonymous.post("/v1/responses", json={**BASE, "input": "x"}), 401)
            assert_openai_error(await anonymous.get("/v1/responses/resp_x"), 401)
        assert_openai_error(await http.post("/v1/responses", json={**BASE, "input": "x" * 3000}), 413)
        import asyncio

        held = asyncio.ensure_future(http.post("/v1/responses", json={**BASE, "input": "x"}))
        while client.num_active == 0:
            await asyncio.sleep(0.005)
        _assert_overloaded(await http.post("/v1/responses", json={**BASE, "input": "y"}))
        client.gate.set()
        assert (await held).status_code == 200


async def test_a_failure_mid_stream_ends_with_response_failed(engine_client, engine):
    class Failing(_GatedClient):
        async def generate_stream(self, prompt, sampling_params, request_id):
            async for output in self.inner.generate_stream(prompt, sampling_params, request_id):
                yield output
                raise EngineUnavailable("the model process died")

    app = create_openai_app(Failing(engine_client), engine.tokenizer, MODEL)
    async with asgi_client(app) as http:
        response = await http.post("/v1/responses", json={**BASE, "input": "x", "stream": True})
        events = _events(response)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        failed = events[-1]
        assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
        assert failed["response"]["error"]["code"] == "engine_unavailable"
        assert (await http.get(f"/v1/responses/{failed['response']['id']}")).json() == failed["response"]
    assert engine_client.aborted  # the request left unfinished was aborted


def test_reasoning_content_becomes_a_reasoning_item_before_the_message():
    output = OutputItems(is_streaming=True)
    for piece in ("Let me ", "think."):
        output.reasoning(piece)
    output.content("Paris.")
    items = output.finish("completed")
    assert [item["type"] for item in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    events = [json.loads(e.split("\ndata: ")[1]) for e in output.take_events().split("\n\n") if e]
    assert [e["type"].removeprefix("response.") for e in events[:6]] == [
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done"]  # fmt: skip
    assert events[-1]["type"] == "response.output_item.done" and events[-1]["item"] == items[1]


def test_text_then_calls_in_pieces_become_one_item_each_in_order():
    """The chat stream's shapes for `auto` (text, then calls) and for calls streamed in
    pieces (the first piece with id and name, then arguments; a new index, a new call)."""
    output = OutputItems(is_streaming=True)
    output.emit("response.created", response={})
    output.emit("response.in_progress", response={})
    output.feed({"role": "assistant", "content": ""})
    output.feed({"content": "Let me look."})
    pieces = [(0, "call_a", "get_weather", '{"city": '), (0, None, None, '"Rome"}'), (1, "call_b", "get_time", "{}")]
    for index, call_id, name, arguments in pieces:
        function = {"arguments": arguments, **({"name": name} if name else {})}
        output.feed({"tool_calls": [{"index": index, "function": function, **({"id": call_id} if call_id else {})}]})
    items = output.finish("completed")
    output.emit_response("response.completed", json.dumps({"output": items}))
    events = [json.loads(e.split("\ndata: ")[1]) for e in output.take_events().split("\n\n") if e]
    final = _check_stream(events)
    assert [(i["type"], i.get("call_id"), i.get("arguments")) for i in final["output"]] == [
        ("message", None, None), ("function_call", "call_a", '{"city": "Rome"}'), ("function_call", "call_b", "{}")]
    assert final["output"][0]["content"][0]["text"] == "Let me look."
