"""The parsers of tool_choice "auto" (`tool_call_parser`, vLLM's names): each reads the
calls of the declared tools out of a free output, as it streams.

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or more
                  (Qwen, Hermes, SmolLM2 templates); text outside the tags is content
    llama3_json   the whole output is {"name": ..., "parameters": {...}} (or several
                  separated by ';'), optionally after <|python_tag|>
    mistral       [TOOL_CALLS] then a JSON array of {"name", "arguments"} objects, or
                  name{...} / name[ARGS]{...} after each [TOOL_CALLS]; text before is content
    pythonic      the whole output is a Python list of calls with literal keyword
                  arguments, [f(a=1), g(b="x")] (Llama 3.2 / 4 templates)
"""

from __future__ import annotations

import ast
import json
import random
import re
import string

from rayserve_paged.engine.tool_calls import (
    Arguments,
    CallArguments,
    CallStart,
    Piece,
    ToolCall,
    ToolSet,
    json_string,
    partial_suffix,
    read_all,
)

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")



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
        name = json_string(head.group(1)) if head is not None else None
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
