"""Tool calls: the constraint that forces them (tool_choice "required" or a named function),
the declared tools calls are checked against, and the readers that stream calls out of an
output (the parsers for tool_choice "auto" are in tool_parsers.py).

    tool_choice "required"   the output is a JSON array of {"name", "parameters"} objects,
                             each naming one of the tools and meeting its parameter schema
    tool_choice named        the output is the named function's arguments (its schema)
    tool_choice "auto"       the model writes what it likes; the deployment's parser
                             (`tool_call_parser`) reads calls out of it (tool_parsers.py)

A call is a call only when it names one of the declared tools and, for a `strict` tool or
one without `parameters` (it takes no arguments), its arguments meet the tool's schema;
anything else stays text, as vLLM's parsers leave it.

Every reader is a stream: `feed(text)` returns the pieces that can be sent now, `finish()`
the rest. A piece is content text, a `CallStart` (a call's id, type and name) or
`CallArguments` (more of a call's arguments). The plain (non-streamed) answer is the same
reader fed the whole text (`read_all`), so a stream and a plain answer always agree.

Pure Python on plain dicts: the HTTP layer and the offline LLM share it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

import jsonschema

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
            value, text = arguments, json_text(arguments)
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


def json_text(value) -> str:
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
                name = json_string(head.group(1)) if head is not None else None
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


def json_string(text: str) -> str | None:
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


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may be completed next)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
