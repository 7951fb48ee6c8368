"""Tool calls: the constraint that forces them (tool_choice "required" or a named function)
and the parsers that find them in free output (tool_choice "auto").

    tool_choice "required"   the output is a JSON array of {"name", "parameters"} objects,
                             each naming one of the tools and meeting its parameter schema
    tool_choice named        the output is the named function's arguments (its schema)
    tool_choice "auto"       the model writes what it likes; the deployment's parser
                             (`tool_call_parser`) reads calls out of it:
        hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen,
                      Hermes, SmolLM2 templates); text outside the tags is content
        llama3_json   the whole output is {"name": ..., "parameters": {...}} (or several
                      separated by ';'), optionally after <|python_tag|>

Pure Python on plain dicts: the HTTP layer and the offline LLM share it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


class ToolChoiceError(ValueError):
    """A tools / tool_choice combination the server cannot honour; the message names the field."""


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


def tool_functions(tools: list[dict] | None) -> dict[str, dict]:
    """name -> its parameter schema, checked: every tool is {"type": "function", "function":
    {"name": str, "parameters": object}} with unique names."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolChoiceError(f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolChoiceError(f"tools[{i}].function.name: a non-empty string is required")
        if name in functions:
            raise ToolChoiceError(f"tools[{i}].function.name: {name!r} is defined twice")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters: a JSON schema object is required")
        functions[name] = parameters
    return functions


def named_function(tool_choice) -> str | None:
    """The function a tool_choice names ({"type": "function", "function": {"name": ...}})."""
    if not isinstance(tool_choice, dict):
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolChoiceError("tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', "
                              "'function': {'name': ...}}")  # fmt: skip
    return name


def forced_schema(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool = True) -> dict | None:
    """The JSON schema that forces tool calls (None: tool_choice does not force them)."""
    if tool_choice in (None, "none", "auto"):
        return None
    functions = tool_functions(tools)
    name = named_function(tool_choice)
    if name is not None:
        if name not in functions:
            raise ToolChoiceError(f"tool_choice: the function {name!r} is not among the tools")
        return functions[name]
    if tool_choice != "required":
        raise ToolChoiceError(f"tool_choice: expected 'none', 'auto', 'required' or a function (got {tool_choice!r})")
    if not functions:
        raise ToolChoiceError("tool_choice: 'required' needs at least one tool")
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for n, schema in functions.items()
        ]
    }
    array = {"type": "array", "items": call, "minItems": 1}
    if not parallel_tool_calls:
        array["maxItems"] = 1
    return array


def forced_calls(text: str, tool_choice) -> list[ToolCall]:
    """The calls in an output produced under forced_schema's constraint; none when the text
    is not whole (a stop string or an abort cut it)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    name = named_function(tool_choice)
    if name is not None:
        return [ToolCall(name, text)]
    if not isinstance(value, list) or not all(isinstance(c, dict) and "name" in c for c in value):
        return []
    return [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value]


# --------------------------------------------------------------------------- parsers (auto)

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a free output; no calls found: (text, [])."""
    if parser == "hermes":
        return _parse_hermes(text)
    if parser == "llama3_json":
        return _parse_llama3_json(text)
    raise ValueError(f"tool_call_parser: expected one of {', '.join(TOOL_CALL_PARSERS)} (got {parser!r})")


def _call_of(obj, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start == -1:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = _call_of(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []  # not a well-formed call: the text stays content
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_of(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\n;":
            pos += 1
    return None, calls


class ToolCallStream:
    """A streamed free output under a parser: text that cannot be part of a call is sent as
    content at once; from where a call may begin (hermes: "<tool_call>", or a piece of it at
    the end of the text so far; llama3_json: an output that opens with "{" or
    "<|python_tag|>") the text is held, and `finish` reads the calls out of it."""

    def __init__(self, parser: str) -> None:
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: expected one of {', '.join(TOOL_CALL_PARSERS)} (got {parser!r})")
        self.parser = parser
        self.held = ""
        self.is_holding = False  # a call may have begun: nothing more is sent until the end
        self.num_sent = 0  # characters sent as content

    def feed(self, text: str) -> str:
        """The content that can be sent now."""
        self.held += text
        if self.is_holding:
            return ""
        if self.parser == "hermes":
            start = self.held.find(_HERMES_OPEN)
            if start != -1:
                self.is_holding = True
                return self._send(start)
            return self._send(len(self.held) - _partial_suffix(self.held, _HERMES_OPEN))
        body = self.held.lstrip()
        if self.num_sent or not body:  # llama3_json calls are the whole output, from its start
            return self._send(len(self.held)) if self.num_sent else ""
        if body.startswith("{") or body.startswith(_PYTHON_TAG):
            self.is_holding = True
            return ""
        if _PYTHON_TAG.startswith(body):
            return ""  # perhaps the tag: wait for the next piece
        return self._send(len(self.held))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content still to send, the calls)."""
        if self.is_holding:
            _, calls = parse_tool_calls(self.parser, self.held)
            if calls:
                return "", calls
        rest, self.held = self.held, ""
        return rest, []

    def _send(self, end: int) -> str:
        out, self.held = self.held[:end], self.held[end:]
        self.num_sent += len(out)
        return out


_HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may be completed next)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
