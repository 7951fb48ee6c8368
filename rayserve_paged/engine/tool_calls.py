"""Tool calls: the constraint that forces them (tool_choice "required" or a named function)
and the parsers that find them in free output (tool_choice "auto").

    tool_choice "required"   the output is a JSON array of {"name", "parameters"} objects,
                             each naming one of the tools and meeting its parameter schema
    tool_choice named        the output is the named function's arguments (its schema)
    tool_choice "auto"       the model writes what it likes; the deployment's parser
                             (`tool_call_parser`, vLLM's names) reads calls out of it:
        hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or more
                      (Qwen, Hermes, SmolLM2 templates); text outside the tags is content
        llama3_json   the whole output is {"name": ..., "parameters": {...}} (or several
                      separated by ';'), optionally after <|python_tag|>
        mistral       [TOOL_CALLS] then a JSON array of {"name", "arguments"} objects, or
                      name{...} / name[ARGS]{...} after each [TOOL_CALLS]; text before is content
        pythonic      the whole output is a Python list of calls with literal keyword
                      arguments, [f(a=1), g(b="x")] (Llama 3.2 / 4 templates)

A call is a call only when it names one of the declared tools and, for a `strict` tool or
one without `parameters` (it takes no arguments), its arguments meet the tool's schema;
anything else stays text, as vLLM's parsers leave it.

Every reader here is a stream: `feed(text)` returns the pieces that can be sent now,
`finish()` the rest. A piece is content text, a `CallStart` (a call's id, type and name)
or `CallArguments` (more of a call's arguments). The plain (non-streamed) answer is the same
reader fed the whole text (`read_all`), so a stream and a plain answer always agree.

Pure Python on plain dicts: the HTTP layer and the offline LLM share it.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from dataclasses import dataclass

import jsonschema

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
# a tool without `parameters` takes no arguments (as OpenAI reads such a definition)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


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


@dataclass(slots=True)
class CallStart:
    """A call begins: its id, type and name are sent first (arguments follow)."""

    index: int
    call: ToolCall


@dataclass(slots=True)
class CallArguments:
    index: int
    text: str


Piece = str | CallStart | CallArguments


def _check_tools(tools: list[dict] | None) -> list[tuple[str, dict, bool]]:
    """(name, parameters schema, strict) of each tool, checked: every tool is {"type":
    "function", "function": {"name": str, "parameters": object, "strict": bool}} with unique
    names; a tool without parameters takes none."""
    checked: list[tuple[str, dict, bool]] = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolChoiceError(f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolChoiceError(f"tools[{i}].function.name: a non-empty string is required")
        if any(name == n for n, _, _ in checked):
            raise ToolChoiceError(f"tools[{i}].function.name: {name!r} is defined twice")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters: a JSON schema object is required")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolChoiceError(f"tools[{i}].function.strict: must be true or false")
        checked.append((name, NO_ARGUMENTS if parameters is None else parameters, parameters is None or bool(strict)))
    return checked


def tool_functions(tools: list[dict] | None) -> dict[str, dict]:
    """name -> its parameter schema (NO_ARGUMENTS for a tool without parameters), checked."""
    return {name: schema for name, schema, _ in _check_tools(tools)}


class ToolSet:
    """The declared tools, as the parsers check calls against them: a call names one of
    them, and a strict tool's (or a tool without parameters') arguments meet its schema.

    Under tool_choice "auto" nothing constrains the output, so strictness is checked on the
    finished call: a call that fails it is not a call (its text stays content). The check is
    jsonschema's; `pattern` is refused for such a tool (400), since a regular expression
    from the request would run on model output in Python's backtracking engine."""

    def __init__(self, tools: list[dict] | None) -> None:
        self._validators: dict[str, jsonschema.protocols.Validator | None] = {}
        for i, (name, schema, strict) in enumerate(_check_tools(tools)):
            if not strict:
                self._validators[name] = None
                continue
            try:
                has_pattern = _has_key(schema, ("pattern", "patternProperties"))
            except RecursionError:
                raise ToolChoiceError(f"tools[{i}].function.parameters: nested too deeply") from None
            if has_pattern:
                raise ToolChoiceError(
                    f"tools[{i}].function.strict: with tool_choice 'auto' a strict tool's arguments are checked "
                    "after generation, and 'pattern' is not checked there; use tool_choice 'required' or a named "
                    "function (the output is then constrained to the schema)"
                )
            try:
                cls = jsonschema.validators.validator_for(schema)
                cls.check_schema(schema)
            except jsonschema.SchemaError as e:
                message = f"tools[{i}].function.parameters: not a valid JSON schema ({e.message})"
                raise ToolChoiceError(message) from None
            except RecursionError:
                raise ToolChoiceError(f"tools[{i}].function.parameters: nested too deeply") from None
            self._validators[name] = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def __contains__(self, name: str) -> bool:
        return name in self._validators

    def is_unchecked(self, name) -> bool:
        """A declared tool whose arguments are not checked (not strict, with parameters):
        its call can be sent before it is whole."""
        return isinstance(name, str) and name in self._validators and self._validators[name] is None

    def call(self, name, arguments, id: str = "") -> ToolCall | None:
        """The call, when it is one: `arguments` a JSON object (or its JSON text)."""
        if not isinstance(name, str) or name not in self._validators:
            return None
        if isinstance(arguments, str):
            try:
                value = json.loads(arguments)
            except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
                return None
            text = arguments
        else:
            value, text = arguments, _json_text(arguments)
        if not isinstance(value, dict):
            return None
        validator = self._validators[name]
        try:
            if validator is not None and not validator.is_valid(value):
                return None
        except RecursionError:
            return None
        return ToolCall(name, text, id)


def _has_key(schema, keys: tuple[str, ...]) -> bool:
    if isinstance(schema, dict):
        return any(k in schema for k in keys) or any(_has_key(v, keys) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_key(v, keys) for v in schema)
    return False


def _json_text(value) -> str:
    """JSON text of a parsed value as OpenAI sends arguments (UTF-8, not escaped); a lone
    surrogate (model text such as "\\ud800" decodes to one) stays an escape, so the answer
    can always be encoded."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


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


# --------------------------------------------------------------------------- reading outputs


def read_all(stream, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output read by `stream` (content None when empty)."""
    return collect([*stream.feed(text), *stream.finish()])


def collect(pieces: list[Piece]) -> tuple[str | None, list[ToolCall]]:
    content, calls = [], {}
    for piece in pieces:
        if isinstance(piece, str):
            content.append(piece)
        elif isinstance(piece, CallStart):
            calls[piece.index] = ToolCall(piece.call.name, "", piece.call.id)
        else:
            calls[piece.index].arguments += piece.text
    return "".join(content) or None, list(calls.values())


def forced_calls(text: str, tool_choice) -> list[ToolCall]:
    """The calls in a whole output produced under forced_schema's constraint; none when
    the text is not whole (a stop string or an abort cut it)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return []
    return read_all(forced_stream(tool_choice), text)[1]


def forced_stream(tool_choice):
    name = named_function(tool_choice)
    return NamedCallStream(name) if name is not None else RequiredCallStream()


class NamedCallStream:
    """A named tool choice: the whole output is the call's arguments, sent as they grow."""

    def __init__(self, name: str) -> None:
        self.call = ToolCall(name, "")
        self.is_started = False

    def feed(self, text: str) -> list[Piece]:
        if not text:
            return []
        pieces: list[Piece] = [] if self.is_started else [CallStart(0, self.call)]
        self.is_started = True
        return [*pieces, CallArguments(0, text)]

    def finish(self) -> list[Piece]:
        return []


# `{"name": "<json string>", "parameters": ` : a call of "required"'s array up to its arguments
_REQUIRED_HEAD = re.compile(r'\s*[\[,]?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(?=\S)')


class RequiredCallStream:
    """tool_choice "required": the output is [{"name": ..., "parameters": ...}, ...] (the
    grammar writes the keys in this order). Each call is sent as soon as its name is whole,
    then its arguments (the text of the "parameters" value, as written) as they grow."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # where the next call's head is read
        self.arguments: Arguments | None = None  # the current call's (None: between calls)
        self.num_calls = 0

    def feed(self, text: str) -> list[Piece]:
        self.text += text
        pieces: list[Piece] = []
        while True:
            if self.arguments is None:
                head = _REQUIRED_HEAD.match(self.text, self.pos)
                name = _json_string(head.group(1)) if head is not None else None
                if name is None:
                    return pieces
                pieces.append(CallStart(self.num_calls, ToolCall(name, "")))
                self.arguments = Arguments(head.end())
            more, end = self.arguments.advance(self.text)
            if more:
                pieces.append(CallArguments(self.num_calls, more))
            close = -1 if end is None else self.text.find("}", end)
            if close == -1:
                return pieces
            self.pos, self.arguments = close + 1, None
            self.num_calls += 1

    def finish(self) -> list[Piece]:
        return []


class Arguments:
    """A call's arguments as they are generated: the text of the JSON value that begins at
    `start`, each piece sent once."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.value_end = JsonValueEnd(start)
        self.num_sent = 0

    def advance(self, text: str, until: str | None = None) -> tuple[str, int | None]:
        """(the arguments' text not sent yet, where the value ends: None while it is not
        whole). With `until` (the tag that closes the call) the arguments also end where that
        tag begins, whole or not, and a piece of it at the end of the text is held."""
        end = self.value_end.scan(text)
        if end is None and until is not None:
            cut = text.find(until, max(self.start, self.start + self.num_sent - len(until)))
            end = cut if cut != -1 else None
            upto = end if end is not None else len(text) - partial_suffix(text, until)
        else:
            upto = len(text) if end is None else end
        upto = max(upto, self.start + self.num_sent)
        more = text[self.start + self.num_sent : upto]
        self.num_sent = upto - self.start
        return more, end


def _json_string(text: str) -> str | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, str) else None


class JsonValueEnd:
    """Where the JSON value that begins at `start` of a growing text ends (None: not whole
    yet), each character read once however the text grows. Objects, arrays and strings end
    at their closing character; a bare number or literal at the next character that cannot
    continue it."""

    def __init__(self, start: int) -> None:
        self.pos = start  # the next character to read
        self.is_bare: bool | None = None  # None: the value's first character not seen yet
        self.depth = 0
        self.in_string = self.escaped = False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        if self.end is not None:
            return self.end
        i, n = self.pos, len(text)
        if self.is_bare is None:
            while i < n and text[i] in " \t\n\r":
                i += 1
            if i == n:
                self.pos = i
                return None
            self.is_bare = text[i] not in '{["'
        if self.is_bare:
            while i < n and text[i] not in ",}] \t\n\r":
                i += 1
            self.pos = i
            self.end = i if i < n else None
            return self.end
        for j in range(i, n):
            c = text[j]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.end = j + 1
                        return self.end
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = j + 1
                    return self.end
        self.pos = n
        return None


# --------------------------------------------------------------------------- parsers (auto)


def parse_tool_calls(
    parser: str, text: str, tools: list[dict] | ToolSet | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a free output under `parser`; no calls found: (text, [])."""
    content, calls = read_all(ToolCallStream(parser, tools), text)
    return (content, calls) if calls else (text, [])


def check_parser(parser: str) -> str:
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser: expected one of {', '.join(TOOL_CALL_PARSERS)} (got {parser!r})")
    return parser


class ToolCallStream:
    """A free output under a parser, read as it streams.

    Text that cannot be part of a call is sent as content at once. From where a call may
    begin (hermes: "<tool_call>", or a piece of it at the end of the text so far; mistral:
    "[TOOL_CALLS]"; llama3_json and pythonic: an output that opens with "{" or
    "<|python_tag|>", or with "[") the text is held. hermes sends a call of a tool whose
    arguments are not checked as it is generated (its name, then its arguments as they
    grow: such a call, once sent, stays one), any other call when its closing tag arrives;
    the other parsers read theirs at the end. Held text that holds no call is sent as
    content. Whitespace next to a call is not content; so an output of calls alone has
    content null.
    """

    def __init__(self, parser: str, tools: list[dict] | ToolSet | None = None) -> None:
        self.parser = check_parser(parser)
        self.tools = tools if isinstance(tools, ToolSet) else ToolSet(tools)
        self.buf = ""  # text not sent yet, after `self.ws`
        self.ws = ""  # whitespace held: content, unless a call follows it
        self.is_after_call = False  # whitespace that follows a call is dropped
        self.is_holding = False  # a call (or the calls) may have begun in `buf`
        self.is_started = False  # any non-whitespace text seen (llama3_json, pythonic: at the start only)
        self.calls: list[ToolCall] = []
        self.live: tuple[int, Arguments] | None = None  # hermes: a call being sent as it is generated

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        if self.parser == "hermes":
            return self._feed_hermes()
        return self._feed_whole()

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        if self.live is not None:  # sent already: a call, closed or not
            self.buf = self.ws = ""
            self.live, self.is_holding = None, False
        if self.is_holding:
            calls = self._read_held(self.buf)
            if calls:
                self.ws = self.buf = ""
                pieces += self._calls(calls)
        rest, self.ws, self.buf = self.ws + self.buf, "", ""
        if rest and not (self.is_after_call and not rest.strip()):
            pieces.append(rest)
        return pieces

    # ---- hermes: calls anywhere, each closed by </tool_call>

    def _feed_hermes(self) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            if self.is_holding and self.live is None:
                pieces += self._start_live_call()
            if self.live is not None:
                index, arguments = self.live
                more, end = arguments.advance(self.buf, _HERMES_CLOSE)
                if more:
                    pieces.append(CallArguments(index, more))
                close = -1 if end is None else self.buf.find(_HERMES_CLOSE, end)
                if close == -1:
                    return pieces
                self.buf, self.is_holding, self.live = self.buf[close + len(_HERMES_CLOSE) :], False, None
                continue
            if self.is_holding:
                close = self.buf.find(_HERMES_CLOSE)
                if close == -1:
                    return pieces
                end = close + len(_HERMES_CLOSE)
                call = self._hermes_call(self.buf[len(_HERMES_OPEN) : close])
                if call is None:  # not a call: its text is content
                    pieces.append(self.ws + self.buf[:end])
                    self.ws, self.is_after_call = "", False
                else:
                    self.ws = ""
                    pieces += self._calls([call])
                self.buf, self.is_holding = self.buf[end:], False
                continue
            if self.is_after_call:  # whitespace after a call: held, content only between texts
                stripped = self.buf.lstrip()
                self.ws += self.buf[: len(self.buf) - len(stripped)]
                if not stripped:
                    self.buf = ""
                    return pieces
                self.buf, self.is_after_call = stripped, False
            start = self.buf.find(_HERMES_OPEN)
            safe = start if start != -1 else len(self.buf) - partial_suffix(self.buf, _HERMES_OPEN)
            pieces += self._send_text(self.buf[:safe])
            self.buf = self.buf[safe:]
            if start == -1:
                return pieces
            self.is_holding = True

    def _start_live_call(self) -> list[Piece]:
        """A call of a declared tool whose arguments are not checked is sent as it is
        generated: its name once `{"name": "...", "arguments": ` is whole, then the arguments'
        text (as written) as it grows. Other calls wait for their </tool_call>."""
        head = _HERMES_HEAD.match(self.buf, len(_HERMES_OPEN))
        name = _json_string(head.group(1)) if head is not None else None
        if not self.tools.is_unchecked(name):
            return []
        index, call = len(self.calls), ToolCall(name, "")
        self.calls.append(call)
        self.live, self.ws, self.is_after_call = (index, Arguments(head.end())), "", True
        return [CallStart(index, call)]

    def _hermes_call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return None
        if not isinstance(obj, dict):
            return None
        return self.tools.call(obj.get("name"), obj.get("arguments", {}))

    # ---- llama3_json, pythonic: the whole output; mistral: from [TOOL_CALLS] on

    def _feed_whole(self) -> list[Piece]:
        if self.is_holding:
            return []
        if self.parser == "mistral":
            start = self.buf.find(_MISTRAL_TAG)
            safe = start if start != -1 else len(self.buf) - partial_suffix(self.buf, _MISTRAL_TAG)
            pieces = self._send_text(self.buf[:safe])
            self.buf, self.is_holding = self.buf[safe:], start != -1
            return pieces
        if self.is_started:
            return self._send_text(self._take())
        body = self.buf.lstrip()
        if not body:
            return []
        opens = ("{", _PYTHON_TAG) if self.parser == "llama3_json" else ("[", _PYTHON_START)
        if body.startswith(opens):
            self.is_holding = True
            return []
        if any(o.startswith(body) for o in opens):
            return []  # perhaps the tag: wait for the next piece
        self.is_started = True
        return self._send_text(self._take())

    def _read_held(self, text: str) -> list[ToolCall]:
        if self.parser == "hermes":
            call = self._hermes_call(text[len(_HERMES_OPEN) :])  # the last call, not closed
            return [call] if call is not None else []
        if self.parser == "llama3_json":
            return _llama3_json_calls(text, self.tools)
        if self.parser == "mistral":
            return _mistral_calls(text, self.tools)
        return _pythonic_calls(text, self.tools)

    # ---- shared

    def _take(self) -> str:
        out, self.buf = self.buf, ""
        return out

    def _send_text(self, text: str) -> list[Piece]:
        """Content, except the whitespace at its end (held: a call may follow it)."""
        if not text:
            return []
        body = text.rstrip()
        if not body:
            self.ws += text
            return []
        held = self.ws if self.is_started or not self.calls else ""  # none between a first call and text
        out, self.ws = held + body, text[len(body) :]
        self.is_started = True
        return [out]

    def _calls(self, calls: list[ToolCall]) -> list[Piece]:
        pieces: list[Piece] = []
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            pieces += [CallStart(index, call), CallArguments(index, call.arguments)]
        self.is_after_call = True
        return pieces


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_PYTHON_TAG = "<|python_tag|>"
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
_MISTRAL_TAG, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def _llama3_json_calls(text: str, tools: ToolSet) -> list[ToolCall]:
    """Calls of `{"name": ..., "parameters": {...}}` objects separated by ';' (the whole
    text); an object without "parameters" / "arguments", or naming no declared tool, makes
    the whole text content (a plain JSON answer such as {"name": "Alice", "age": 30})."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return []
        key = "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments"
        call = tools.call(obj.get("name"), obj[key]) if isinstance(obj, dict) and key in obj else None
        if call is None:
            return []
        calls.append(call)
        while pos < len(body) and body[pos] in " \t\n\r;":
            pos += 1
    return calls


def _mistral_calls(text: str, tools: ToolSet) -> list[ToolCall]:
    """From the first [TOOL_CALLS]: a JSON array of {"name", "arguments"} (Mistral's v3
    tokenizers), or `name{...}` / `name[ARGS]{...}` after each tag (v11 and later). Mistral's
    templates need call ids of 9 letters and digits."""
    parts = [p.strip() for p in text.split(_MISTRAL_TAG)[1:]]
    found: list[tuple[object, object]] = []
    if len(parts) == 1 and parts[0].startswith("["):
        try:
            value = json.loads(parts[0])
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return []
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            return []
        found = [(v.get("name"), v.get("arguments", v.get("parameters", {}))) for v in value]
    else:
        for part in parts:
            name, sep, arguments = part.partition(_MISTRAL_ARGS)
            if not sep:
                brace = part.find("{")
                name, arguments = (part[:brace], part[brace:]) if brace != -1 else (part, "")
            found.append((name.strip(), arguments.strip()))
    calls = [tools.call(name, arguments, _mistral_id()) for name, arguments in found]
    return calls if calls and all(c is not None for c in calls) else []


def _mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def _pythonic_calls(text: str, tools: ToolSet) -> list[ToolCall]:
    """The whole text is a Python list of calls, [name(key=literal, ...), ...]."""
    body = text.strip().removeprefix(_PYTHON_START).removesuffix(_PYTHON_END).strip()
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return []
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return []
        if None in arguments:  # **kwargs
            return []
        try:
            call = tools.call(node.func.id, arguments)
        except (TypeError, ValueError):  # a literal JSON cannot hold (bytes, a set, a complex number)
            return []
        if call is None:
            return []
        calls.append(call)
    return calls


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may be completed next)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
