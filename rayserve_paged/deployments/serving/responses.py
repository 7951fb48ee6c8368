"""POST /v1/responses (OpenAI's Responses API), GET / DELETE /v1/responses/{id} and its
input items, over the chat route.

    ResponsesRequest ──> input items (+ the stored conversation of previous_response_id)
                         + instructions ──> a ChatCompletionRequest
                              │  ChatServing.create_chat_completion: the chat template, the
                              │  constraint (text.format), forced or parsed tool calls, limits
                              ▼
                         its answer (a body, or its SSE chunks as they come) ──> OutputItems:
                         message / function_call / reasoning items, and the typed events

One generation path: the chat route renders, constrains, generates and reads tool calls;
this module only translates its answer, in the chat API's own wire shape, into the
Responses shape. A non-streamed answer is fed to OutputItems as one delta, so both ways
build the same items. The chat route's stream is already coalesced (one chunk per engine
step, or per stream_batching_interval_ms), and each chunk becomes the events it implies,
sent together.

State: finished responses with `store` (the default) go into the replica's ResponseStore
(response_store.py); `previous_response_id` continues the stored conversation (its input
items and output; not its instructions, as OpenAI's).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError, field_validator

from rayserve_paged.deployments.admission import Admission
from rayserve_paged.deployments.errors import OpenAIError, bad_request, validation_error
from rayserve_paged.deployments.protocol import (
    GenerationRequest,
    RequestModel,
    check_entries,
    documented,
    unicode_checked,
)
from rayserve_paged.deployments.serving.chat import ChatCompletionRequest, ChatServing
from rayserve_paged.deployments.serving.pipeline import log_unknown_fields
from rayserve_paged.deployments.serving.response_store import ResponseStore, StoredResponse
from rayserve_paged.deployments.sse import EventStreamResponse, json_value

logger = logging.getLogger(__name__)

MAX_METADATA_KEYS = 16  # OpenAI's bounds on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_INPUT_ITEMS = 2048  # items in one request's `input`
_F = GenerationRequest.model_fields  # the sampling fields the chat route shares, as it documents them


# --------------------------------------------------------------------------- request models


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text (free), json_object (any JSON object) or json_schema (the given schema)."
    )
    name: str = Field("response", description="json_schema: the schema's name (accepted, not used).")
    description: str | None = Field(None, description="json_schema: what the schema is for (accepted, not used).")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="json_schema: the JSON schema the output must meet (required)."
    )
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced (constrained decoding).")

    def response_format(self) -> dict[str, Any] | None:
        """The chat route's response_format for this format."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise bad_request("text.format.schema: required when type is 'json_schema'")
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_, "strict": self.strict}}


class TextConfig(RequestModel):
    format: TextFormat | None = Field(None, description="The output's format; omitted = text.")
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted, not used.")


class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Accepted; no served model takes an effort (docs/API.md)."
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="Accepted, not used.")
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="Older name of summary.")


class ResponsesRequest(RequestModel):
    """POST /v1/responses."""

    model: str | None = _F["model"]
    input: str | list[dict[str, Any]] = Field(
        description="A user message's text, or a list of input items: messages ({role, content: text or "
        "input_text parts}), function_call and function_call_output items (docs/API.md)."
    )
    instructions: str | None = Field(
        None, description="A system message put first; not carried over to a continuation (previous_response_id)."
    )
    max_output_tokens: int | None = Field(
        None, description="Most tokens to generate; omitted = up to the model's context length.", **documented(minimum=1)
    )
    temperature: float | None = _F["temperature"]
    top_p: float | None = _F["top_p"]
    seed: int | None = _F["seed"]
    stop: str | list[str] | None = _F["stop"]
    top_k: int | None = _F["top_k"]
    min_p: float | None = _F["min_p"]
    presence_penalty: float | None = _F["presence_penalty"]
    frequency_penalty: float | None = _F["frequency_penalty"]
    repetition_penalty: float | None = _F["repetition_penalty"]
    cache_salt: str | None = _F["cache_salt"]
    ignore_eos: bool = _F["ignore_eos"]
    tools: list[dict[str, Any]] | None = Field(
        None, description="Function tools: {type: 'function', name, description, parameters, strict}."
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="'none', 'auto' (default), 'required' or {type: 'function', name}."
    )
    parallel_tool_calls: bool = Field(True, description="With tool_choice 'required': allow more than one call.")
    text: TextConfig | None = Field(None, description="text.format: text, json_object or json_schema.")
    reasoning: ReasoningConfig | None = Field(None, description="Accepted; ignored (docs/API.md, Responses).")
    metadata: dict[str, str] | None = Field(
        None, description=f"Up to {MAX_METADATA_KEYS} string pairs, returned with the response."
    )
    user: str | None = _F["user"]
    stream: bool = Field(False, description="Answer with the typed server-sent events.")
    store: bool = Field(True, description="Keep the response on this replica for previous_response_id and GET.")
    previous_response_id: str | None = Field(None, description="Continue the conversation of a stored response.")
    truncation: Literal["disabled", "auto"] = Field(
        "disabled", description="disabled: past the context is a 400; auto: the oldest input items are dropped."
    )
    include: list[str] | None = Field(None, description="Accepted; nothing extra is included.")
    background: bool = Field(False, description="Not supported (true is a 400).")

    _check_text = unicode_checked("input", "instructions", "tools", "tool_choice", "metadata", "previous_response_id")

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, metadata):
        return check_entries(metadata, MAX_METADATA_KEYS, "keys", _check_metadata_entry)


def _check_metadata_entry(key: str, value: str) -> None:
    if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
        raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                         f"{MAX_METADATA_VALUE_CHARS}")  # fmt: skip


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class TextPart(RequestModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(RequestModel):
    type: Literal["refusal"]
    refusal: str


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    id: str | None = None


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]
    id: str | None = None


class ReasoningItem(RequestModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)


_ITEMS: dict[str, type[RequestModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
_PARTS: dict[str, type[RequestModel]] = {"input_text": TextPart, "output_text": TextPart, "text": TextPart,
                                         "refusal": RefusalPart}  # fmt: skip
_NOT_TEXT = ("input_image", "input_file", "input_audio")


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# --------------------------------------------------------------------------- input items


def _checked(model: type[RequestModel], value: Any, where: str) -> RequestModel:
    """`value` as `model`, or a 400 naming the first field at fault under `where`."""
    if not isinstance(value, dict):
        raise bad_request(f"{where}: expected an object", param=where)
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"] if p not in _UNION_TAGS)
        message = "field required" if error["type"] == "missing" else error["msg"].removeprefix("Value error, ")
        raise bad_request(f"{where}{path}: {message}", param=where + path) from None


_UNION_TAGS = frozenset({"str", "list[dict[str,any]]", "dict[str,any]"})


def _parts_text(parts: str | list[dict[str, Any]], where: str) -> list[str]:
    if isinstance(parts, str):
        return [parts]
    texts = []
    for j, raw in enumerate(parts):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise bad_request(f"{where}[{j}].type: expected a string naming the part's type")
        if kind in _NOT_TEXT:
            raise bad_request(f"{where}[{j}].type: {kind!r} parts are not supported (this server serves text only)")
        if kind not in _PARTS:
            raise bad_request(f"{where}[{j}].type: expected one of {', '.join(_PARTS)} (got {ascii(kind)[:40]})")
        part = _checked(_PARTS[kind], raw, f"{where}[{j}]")
        texts.append(part.text if isinstance(part, TextPart) else part.refusal)
    return texts


def parse_input(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as normalized items (each with an id, content as parts), the
    form the store keeps and GET .../input_items lists; a 400 naming the item at fault."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if len(value) > MAX_INPUT_ITEMS:
        raise bad_request(f"input: at most {MAX_INPUT_ITEMS} items (got {len(value)})")
    items = []
    for i, raw in enumerate(value):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        if not isinstance(kind, str) or kind not in _ITEMS:
            raise bad_request(f"{where}.type: {ascii(kind)[:40]} items are not supported (expected one of "
                              f"{', '.join(_ITEMS)})")  # fmt: skip
        item = _checked(_ITEMS[kind], raw, where)
        if isinstance(item, MessageItem):
            texts = _parts_text(item.content, f"{where}.content")
            part = "output_text" if item.role == "assistant" else "input_text"
            extra = {"annotations": []} if item.role == "assistant" else {}
            content = [{"type": part, "text": text, **extra} for text in texts]
            items.append({"id": item.id or _item_id("msg"), "type": "message", "role": item.role, "content": content,
                          "status": "completed"})  # fmt: skip
        elif isinstance(item, FunctionCallItem):
            items.append({"id": item.id or _item_id("fc"), "type": "function_call", "call_id": item.call_id,
                          "name": item.name, "arguments": item.arguments, "status": "completed"})  # fmt: skip
        elif isinstance(item, FunctionCallOutputItem):
            output = "".join(_parts_text(item.output, f"{where}.output"))
            items.append({"id": item.id or _item_id("fco"), "type": "function_call_output", "call_id": item.call_id,
                          "output": output, "status": "completed"})  # fmt: skip
        else:
            items.append({"id": item.id or _item_id("rs"), "type": "reasoning", "summary": item.summary})
    return items


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages: instructions first (a system message), an
    assistant's function calls as its tool_calls, their outputs as tool messages.
    Reasoning items are not rendered (the chat templates take none back)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            parts = [{"type": "text", "text": part["text"]} for part in item["content"]]
            messages.append({"role": item["role"], "content": parts})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # its text, then its calls: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- output items and events


class OutputItems:
    """The chat answer's pieces (reasoning, content, tool-call deltas in the chat stream's
    shape) in, Responses output items out; while streaming, also each item's typed events,
    numbered from `sequence_number`.

        output_item.added ─ content_part.added ─ output_text.delta ... ─ output_text.done
          ─ content_part.done ─ output_item.done          (a message; reasoning alike)
        output_item.added ─ function_call_arguments.delta ... ─ .done ─ output_item.done

    At most one item is open: a piece of another kind (or another call's index) closes it.
    """

    def __init__(self, is_streaming: bool) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[str] | None = [] if is_streaming else None
        self.sequence_number = 0
        self._open: dict[str, Any] | None = None
        self._pieces: list[str] = []  # the open item's text or arguments so far
        self._call_index: int | None = None  # the chat tool_call index of an open function_call
        self._delta_event = ""  # the open item's delta event type
        self._delta_head = ""  # ... and its JSON up to the "delta" value

    # ------------------------------------------------------------ what comes in

    def feed(self, delta: dict[str, Any]) -> None:
        """A chat delta (or a whole chat message): its reasoning (vLLM's `reasoning_content`,
        or its newer name `reasoning`), its text, its calls."""
        self.reasoning(delta.get("reasoning_content") or delta.get("reasoning") or "")
        self.content(delta.get("content") or "")
        for piece in delta.get("tool_calls") or ():
            self.tool_call(piece)

    def reasoning(self, text: str) -> None:
        if text:
            self._text("reasoning", text)

    def content(self, text: str) -> None:
        if text:
            self._text("message", text)

    def tool_call(self, piece: dict[str, Any]) -> None:
        """One entry of a chat delta's tool_calls: {index, id?, function: {name?, arguments?}}."""
        index = piece.get("index", 0)
        function = piece.get("function") or {}
        if self._open is None or self._open["type"] != "function_call" or self._call_index != index:
            self._close("completed")
            self._call_index = index
            self._start({"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                         "call_id": piece.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                         "name": function.get("name") or ""})  # fmt: skip
        arguments = function.get("arguments")
        if arguments:
            self._pieces.append(arguments)
            if self.events is not None:
                self.events.append(self._delta(arguments))

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the open item; an answer with no item at all is one empty message."""
        item_status = "completed" if status == "completed" else "incomplete"
        if not self.items and status != "failed":
            self._start(_message_item())
        self._close(item_status)
        return self.items

    # ------------------------------------------------------------ items

    def _text(self, kind: str, text: str) -> None:
        if self._open is None or self._open["type"] != kind:
            self._close("completed")
            self._start(_message_item() if kind == "message" else
                        {"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": []})  # fmt: skip
        self._pieces.append(text)
        if self.events is not None:
            self.events.append(self._delta(text))

    def _start(self, item: dict[str, Any]) -> None:
        self._open = item
        self._pieces = []
        index = len(self.items)
        self.items.append(item)
        self.emit("response.output_item.added", output_index=index, item=item)
        kind = item["type"]
        if kind == "function_call":
            self._delta_event = event = "response.function_call_arguments.delta"
            self._delta_head = f'"type":"{event}","item_id":{json_value(item["id"])},"output_index":{index}'
            return
        self.emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                  part=_part(kind, ""))  # fmt: skip
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        self._delta_event = event
        head = f'"type":"{event}","item_id":{json_value(item["id"])},"output_index":{index},"content_index":0'
        self._delta_head = head + (',"logprobs":[]' if kind == "message" else "")

    def _close(self, status: str) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        index = len(self.items) - 1
        text = "".join(self._pieces)
        kind = item["type"]
        if kind == "function_call":
            item["arguments"] = text
            self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      name=item["name"], arguments=text)  # fmt: skip
        else:
            part = _part(kind, text)
            done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
            logprobs = {"logprobs": []} if kind == "message" else {}
            self.emit(done, item_id=item["id"], output_index=index, content_index=0, text=text, **logprobs)
            self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part)  # fmt: skip
            item["content"] = [part]
        item["status"] = status
        self.emit("response.output_item.done", output_index=index, item=item)

    # ------------------------------------------------------------ events

    def emit(self, event: str, **fields) -> None:
        if self.events is None:
            return
        body = json.dumps({"type": event, **fields, "sequence_number": self.sequence_number}, ensure_ascii=False,
                          separators=(",", ":"))  # fmt: skip
        self.sequence_number += 1
        self.events.append(f"event: {event}\ndata: {body}\n\n")

    def _delta(self, text: str) -> str:
        """A delta event, formatted without a dict (one per token on the hot path)."""
        number = self.sequence_number
        self.sequence_number += 1
        return (f'event: {self._delta_event}\ndata: {{{self._delta_head},"delta":{json_value(text)},'
                f'"sequence_number":{number}}}\n\n')  # fmt: skip

    def emit_response(self, event: str, response_json: str) -> None:
        """A lifecycle event around a response body already written as JSON."""
        if self.events is None:
            return
        number = self.sequence_number
        self.sequence_number += 1
        self.events.append(f'event: {event}\ndata: {{"type":"{event}","response":{response_json},'
                           f'"sequence_number":{number}}}\n\n')  # fmt: skip

    def take_events(self) -> str:
        events, self.events = self.events, []
        return "".join(events)


def _message_item() -> dict[str, Any]:
    return {"id": _item_id("msg"), "type": "message", "status": "in_progress", "content": [], "role": "assistant"}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    return {"type": "reasoning_text", "text": text}


# the chat answer's finish_reason -> the response's status (and incomplete_details.reason)
_STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}


def _status_of(finish_reason: str | None) -> str:
    return _STATUS.get(finish_reason, "failed")


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


# the chat route's field names in its errors -> this route's (longest first)
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def _renamed(error: OpenAIError) -> OpenAIError:
    """The chat route's error naming this route's fields."""
    info = error.info
    for chat_name, name in _RENAMES:
        if info.param is not None and info.param.startswith(chat_name):
            info.param = name + info.param[len(chat_name) :]
        if info.message.startswith(chat_name):
            info.message = name + info.message[len(chat_name) :]
    if info.param is not None and info.param.startswith("tools[") and ".function." in info.param:
        info.param = info.param.replace(".function.", ".", 1)
        info.message = info.message.replace(".function.", ".", 1)
    return error


# --------------------------------------------------------------------------- the route


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.pipeline = chat.pipeline
        self.store = store if store is not None else ResponseStore()

    def conversation_of(self, request: ResponsesRequest) -> str | None:
        """The conversation a continuation belongs to (its routing session), if stored."""
        if request.previous_response_id is None:
            return None
        entry = self.store.get(request.previous_response_id)
        return entry.conversation_id if entry is not None else None

    async def create_response(self, request: ResponsesRequest, admission: Admission | None = None) -> Response:
        log_unknown_fields(request)
        if request.background:
            raise bad_request("background: background responses are not supported by this server", param="background")
        history, conversation_id = self._history(request.previous_response_id)
        items = parse_input(request.input)
        response_id = f"resp_{uuid.uuid4().hex}"
        chat_request = self._chat_request(request, history + items)
        if request.truncation == "auto":
            history, items, chat_request = await self._truncated(request, history, items, chat_request)
        try:
            answer = await self.chat.create_chat_completion(chat_request, admission)
        except OpenAIError as exc:
            raise _renamed(exc) from None
        record = _Record(self, request, response_id, history + items, len(items), conversation_id or response_id)
        if not request.stream:
            body = json.loads(answer.body)
            (choice,) = body["choices"]
            message = choice["message"]
            output = OutputItems(is_streaming=False)
            calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or [])]
            output.feed({**message, "tool_calls": calls})  # the whole answer as one delta
            status = _status_of(choice["finish_reason"])
            final = record.final(output.finish(status), status, _usage(body["usage"]))
            return Response(final, media_type="application/json")
        return EventStreamResponse(self._events(record, answer.body_iterator), answer.outputs)

    async def _events(self, record: _Record, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The chat route's SSE chunks as Responses events: one chunk out per chunk in."""
        output = OutputItems(is_streaming=True)
        snapshot = record.snapshot()
        output.emit("response.created", response=snapshot)
        output.emit("response.in_progress", response=snapshot)
        finish_reason = usage = error = None
        try:
            async for chunk in chunks:
                for event in chunk.split("\n\n"):
                    data = event[6:]  # after "data: "
                    if not data or data == "[DONE]":
                        continue
                    body = json.loads(data)
                    if "error" in body:
                        error = body["error"]
                        continue
                    for choice in body["choices"]:
                        output.feed(choice["delta"])
                        finish_reason = choice["finish_reason"] or finish_reason
                    usage = body.get("usage") or usage
                if chunk.endswith("data: [DONE]\n\n"):
                    status = "failed" if error is not None else _status_of(finish_reason)
                    items = output.finish(status)
                    final = record.final(items, status, _usage(usage), error)
                    output.emit_response(f"response.{status}", final)
                events = output.take_events()
                if events:
                    yield events
        finally:
            await chunks.aclose()

    # ---------------------------------------------------------------- the conversation

    def _history(self, previous_response_id: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The stored conversation a continuation extends: the previous response's input
        items (earlier turns first) and its output; (its items, its conversation's id)."""
        if previous_response_id is None:
            return [], None
        entry = self.store.get(previous_response_id)
        if entry is None:
            raise self.not_found(previous_response_id, "previous_response_id")
        output = json.loads(entry.response_json)["output"]
        return json.loads(entry.conversation_json) + output, entry.conversation_id

    def _chat_request(self, request: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
        messages = chat_messages(request.instructions, items)
        if not messages:
            raise bad_request("input: the conversation is empty (no input items and no instructions)", param="input")
        body: dict[str, Any] = {
            "model": request.model,
            "messages": messages,
            "max_completion_tokens": request.max_output_tokens,
            "tools": self._chat_tools(request.tools),
            "tool_choice": _chat_tool_choice(request.tool_choice),
            "parallel_tool_calls": request.parallel_tool_calls,
            "response_format": _chat_response_format(request),
            "stream": request.stream,
            "stream_options": {"include_usage": True} if request.stream else None,
        }
        for name in ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "cache_salt", "ignore_eos", "user"):  # fmt: skip
            body[name] = getattr(request, name)
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:  # a rule only the chat model checks (stop's count, ...)
            raise _renamed(validation_error(RequestValidationError(exc.errors()))) from None

    @staticmethod
    def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if not tools:
            return None
        chat_tools = []
        for i, tool in enumerate(tools):
            kind = tool.get("type")
            if kind != "function":
                raise bad_request(f"tools[{i}].type: only function tools are supported (got {ascii(kind)[:40]})")
            chat_tools.append(_checked(FunctionTool, tool, f"tools[{i}]").for_chat())
        return chat_tools

    async def _truncated(
        self, request: ResponsesRequest, history: list[dict], items: list[dict], chat_request: ChatCompletionRequest
    ) -> tuple[list[dict], list[dict], ChatCompletionRequest]:
        """truncation "auto": the oldest items dropped until the rendered conversation and
        max_output_tokens fit the context (the instructions stay). A kept conversation
        starts at a message, never at a call's output without its call; the fewest items
        that fit are found by bisection over those starts (a render each)."""
        conversation = history + items
        info = await self.pipeline.model_info()
        room = info["max_model_len"] - (request.max_output_tokens or 1)

        async def fits(chat: ChatCompletionRequest) -> bool:
            prompt = await self.pipeline.in_pool(lambda: self.chat.render(chat))
            return len(prompt.token_ids) <= room

        if await fits(chat_request):
            return history, items, chat_request
        starts = [i for i, item in enumerate(conversation) if i > 0 and item["type"] == "message"]
        if not starts:
            return history, items, chat_request  # nothing to drop: the chat route answers the 400
        low, high = 0, len(starts) - 1
        best = self._chat_request(request, conversation[starts[high]:])
        while low < high:  # the first start that fits; the last is used when none does
            middle = (low + high) // 2
            candidate = self._chat_request(request, conversation[starts[middle]:])
            if await fits(candidate):
                high, best = middle, candidate
            else:
                low = middle + 1
        start = starts[high]
        num_history = max(0, len(history) - start)
        return conversation[start : start + num_history], conversation[start + num_history :], best

    # ---------------------------------------------------------------- stored responses

    def not_found(self, response_id: str, param: str | None = None) -> OpenAIError:
        config = self.store.config
        return OpenAIError(
            404,
            f"no response with id {ascii(response_id)[:80]} is stored on this replica: it is unknown, was deleted, "
            f"was made with store: false, or left the store (which keeps at most {config.max_responses} responses "
            f"and {config.max_bytes} bytes, each for {config.ttl_s:g} s after its last use)",
            type="not_found_error" if param is None else "invalid_request_error",
            param=param,
            code="response_not_found",
        )

    def _entry(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise self.not_found(response_id)
        return entry

    def get_response(self, response_id: str) -> Response:
        return Response(self._entry(response_id).response_json, media_type="application/json")

    def delete_response(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise self.not_found(response_id)
        return DeletedResponse(id=response_id)

    def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> InputItemList:
        entry = self._entry(response_id)
        items = json.loads(entry.conversation_json)[-entry.num_input_items :] if entry.num_input_items else []
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"after: no input item {ascii(after)[:80]} in this response", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)  # fmt: skip


def _chat_response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    """text.format constrains the answer's text; a forced call (tool_choice 'required' or a
    function) answers with calls and no text, so the format has nothing to constrain then
    (OpenAI accepts both together; the chat route's constraint is the call's schema)."""
    if request.text is None or request.text.format is None:
        return None
    response_format = request.text.format.response_format()
    if request.tools and request.tool_choice not in (None, "none", "auto"):
        return None
    return response_format


def _chat_tool_choice(tool_choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice  # the chat route checks the name ('none', 'auto', 'required')
    if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
        raise bad_request("tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                          param="tool_choice")  # fmt: skip
    return {"type": "function", "function": {"name": tool_choice["name"]}}


@dataclass(slots=True)
class _Record:
    """One response's fixed fields, its final body, and its place in the store."""

    serving: ResponsesServing
    request: ResponsesRequest
    response_id: str
    conversation: list[dict]  # its input items, earlier turns first
    num_input_items: int  # of those, the request's own
    conversation_id: str  # the first response of its chain
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list, usage: dict | None, error: dict | None = None) -> dict[str, Any]:
        request = self.request
        fmt = request.text.format if request.text and request.text.format else None
        text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}
        reasoning = request.reasoning
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.serving.pipeline.model_name(request),
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": reasoning and reasoning.effort, "summary": reasoning and reasoning.summary},
            "store": request.store,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": text_format},
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": request.tools or [],
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": request.truncation,
            "usage": usage,
            "user": request.user,
            "metadata": request.metadata or {},
        }

    def snapshot(self) -> dict[str, Any]:
        return self.body("in_progress", [], None)

    def final(self, output: list, status: str, usage: dict | None, error: dict | None = None) -> str:
        """The finished response's JSON, kept in the store when the request asked so."""
        if status == "failed" and error is None:
            error = {"code": "server_error", "message": "the generation ended before it finished (aborted)"}
        elif error is not None:
            error = {"code": error.get("code") or "server_error", "message": error.get("message", "")}
        text = json.dumps(self.body(status, output, usage, error), ensure_ascii=False, separators=(",", ":"))
        if self.request.store:
            entry = StoredResponse(text.encode(), json.dumps(self.conversation, ensure_ascii=False).encode(),
                                   self.num_input_items, self.conversation_id)  # fmt: skip
            self.serving.store.put(self.response_id, entry)
        return text
