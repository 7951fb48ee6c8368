"""Tool-call schemas and forced-call streams (engine/tool_calls.py), the parsers
(engine/tool_parsers.py) and LLM.chat with tools."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.engine.tool_calls import (
    CallStart,
    RequiredCallStream,
    ToolChoiceError,
    ToolSet,
    collect,
    forced_calls,
    forced_schema,
)
from rayserve_paged.engine.tool_parsers import ToolCallStream, parse_tool_calls

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},
]


def test_hermes_reads_calls_and_keeps_the_text_before_them():
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "ping", "arguments": {}}</tool_call>')  # fmt: skip
    content, calls = parse_tool_calls("hermes", text, TOOLS)
    assert content == "Checking."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}'), ("ping", "{}")]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls("hermes", "no calls here", TOOLS) == ("no calls here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls("hermes", broken, TOOLS) == (broken, [])  # not a call: the text stays content


def test_llama3_json_reads_one_or_several_calls():
    content, calls = parse_tool_calls("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', TOOLS)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}')]
    two = '{"name": "ping", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert [c.name for c in parse_tool_calls("llama3_json", two, TOOLS)[1]] == ["ping", "get_weather"]
    assert parse_tool_calls("llama3_json", "Hello {", TOOLS) == ("Hello {", [])
    with pytest.raises(ValueError, match="tool_call_parser"):
        parse_tool_calls("xml", "x")


def test_forced_schemas():
    required = forced_schema(TOOLS, "required")
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(good, required)
    for bad in ([], [{"name": "get_weather", "parameters": {"city": "Oslo"}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    assert forced_schema(TOOLS, "required", parallel_tool_calls=False)["maxItems"] == 1
    assert forced_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}}) == WEATHER
    assert forced_schema(TOOLS, "auto") is None and forced_schema(TOOLS, "none") is None
    for tools, choice, field in (
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([], "required", "tool_choice"),
        ([{"type": "function", "function": {"name": "a"}}] * 2, "required", "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "a", "parameters": []}}], "required", "tools[0].function.parameters"),
    ):
        with pytest.raises(ToolChoiceError, match="^" + re.escape(field) + ":"):
            forced_schema(tools, choice)
    assert forced_calls('[{"name": "ping", "parameters": {}}]', "required")[0].arguments == "{}"
    assert forced_calls('[{"name": "pi', "required") == []  # cut short: no call


def test_llm_chat_with_required_and_named_tools(tiny_paths):
    llm = LLM(model=tiny_paths["opt"], max_model_len=256, num_gpu_blocks_override=32, swap_space_gb=0.01)
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=2)
    for out in llm.chat(messages, params, use_tqdm=False, tools=TOOLS, tool_choice="required"):
        for choice in out.outputs:
            assert choice.tool_calls, choice.text
            for call in choice.tool_calls:
                assert call.name in ("get_weather", "ping")
                if call.name == "get_weather":
                    jsonschema.validate(json.loads(call.arguments), WEATHER)
    named = {"type": "function", "function": {"name": "get_weather"}}
    (out,) = llm.chat(messages, SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False, tools=TOOLS,
                      tool_choice=named)  # fmt: skip
    (call,) = out.outputs[0].tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    (free,) = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False, tools=TOOLS)
    assert free.outputs[0].tool_calls is None  # no parser, no forced choice: plain text


@pytest.mark.parametrize("pieces", [1, 3])
def test_a_stream_sends_content_until_a_call_may_begin(pieces):
    def run(parser, text):
        stream = ToolCallStream(parser, TOOLS)
        size = max(1, len(text) // pieces) if pieces > 1 else 1  # one character at a time, or in chunks
        fed = [p for i in range(0, len(text), size) for p in stream.feed(text[i : i + size])]
        sent = "".join(p for p in fed if isinstance(p, str))
        end = stream.finish()
        rest = "".join(p for p in end if isinstance(p, str))
        return sent, rest, [(c.name, c.arguments) for c in collect(fed + end)[1]]

    call = '<tool_call>{"name": "ping", "arguments": {"x": 1}}</tool_call>'
    sent, rest, calls = run("hermes", "Let me see. " + call.replace('{"x": 1}', "{}"))
    assert sent == "Let me see." and rest == "" and calls == [("ping", "{}")]  # the space next to the call is not content
    # a "<" that starts no call is held only until it cannot be one
    assert run("hermes", "a < b <tool no") == ("a < b <tool no", "", [])
    # it may have begun (and the space before it is content only if no call follows): held, sent at the end
    assert run("hermes", "x <tool") == ("x", " <tool", [])
    sent, rest, calls = run("hermes", "a < b, <tool_call>{broken")
    assert (sent, rest, calls) == ("a < b,", " <tool_call>{broken", [])  # not a call: the rest is content
    sent, rest, calls = run("llama3_json", '<|python_tag|>{"name": "ping", "parameters": {}}')
    assert (sent, rest, calls) == ("", "", [("ping", "{}")])
    sent, rest, calls = run("llama3_json", "Hello {there}")
    assert sent + rest == "Hello {there}" and calls == []


STRICT = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}, TOOLS[1]]


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        # only declared tools are called; the text of anything else stays content
        ("hermes", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', None, []),
        ("hermes", 'A\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>\nB <tool_call>{"name": "ping"}'
                   '</tool_call>\n\n', "A\nB", [("ping", "{}"), ("ping", "{}")]),
        ("hermes", '<tool_call>{"name": "ping", "arguments": {"x": 1}}</tool_call>', None, []),  # takes no arguments
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>', None,
         [("get_weather", '{"city": "\\ud800"}')]),  # an escape to a lone surrogate stays an escape
        ("hermes", "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", None, []),  # past json's depth
        # a call sent as it was generated stays one, and its arguments end at its closing tag
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> then', "then",
         [("get_weather", '{"city": ')]),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}', None,
         [("get_weather", '{"city": "Rome"}')]),  # not closed: the output ended
        ("llama3_json", '{"name": "Alice", "age": 30}', None, []),  # a JSON answer, not a call
        ("llama3_json", '{"name": "ping", "arguments": {}}', None, [("ping", "{}")]),
        ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Sure.",
         [("get_weather", '{"city": "Rome"}')]),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]ping{}', None,
         [("get_weather", '{"city": "Paris"}'), ("ping", "{}")]),
        ("mistral", '[TOOL_CALLS][{"name": "rm", "arguments": {}}]', None, []),
        ("pythonic", '[get_weather(city="Rome"), ping()]', None, [("get_weather", '{"city": "Rome"}'), ("ping", "{}")]),
        ("pythonic", '<|python_start|>[ping()]<|python_end|>', None, [("ping", "{}")]),
        ("pythonic", "[ping(), print(1)]", None, []),  # print is not a tool
        ("pythonic", "[ping(1)]", None, []),  # positional arguments name nothing
        ("pythonic", "[get_weather(city={1, 2})]", None, []),  # no JSON for a set
        ("pythonic", "Just text [1]", None, []),
    ],
)
def test_parsers_read_only_calls_of_the_declared_tools(parser, text, content, calls):
    got_content, got = parse_tool_calls(parser, text, TOOLS)
    assert [(c.name, c.arguments) for c in got] == calls
    assert got_content == (content if calls else text)
    stream = ToolCallStream(parser, TOOLS)  # the same, fed a character at a time
    streamed = collect([p for c in text for p in stream.feed(c)] + stream.finish())
    assert (streamed[0], [(c.name, c.arguments) for c in streamed[1]]) == (content if calls else text, calls)


def test_strict_tools_are_checked_and_patterns_refused_under_auto():
    ok = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    assert parse_tool_calls("hermes", ok, STRICT)[1][0].arguments == '{"city": "Rome"}'
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert parse_tool_calls("hermes", bad, STRICT) == (bad, [])
    assert parse_tool_calls("hermes", bad, TOOLS)[1]  # not strict: the call stands
    patterned = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}}}]  # fmt: skip
    with pytest.raises(ToolChoiceError, match=r"^tools\[0\]\.function\.strict:"):
        ToolSet(patterned)
    with pytest.raises(ToolChoiceError, match=r"^tools\[0\]\.function\.strict:"):
        ToolSet([{"type": "function", "function": {"name": "f", "strict": 1}}])


def test_required_stream_sends_each_call_as_its_name_is_whole():
    text = '[{"name": "get_weather", "parameters": {"city": "Ro}m\\"e"}}, {"name": "ping", "parameters": {}}]'
    stream, pieces = RequiredCallStream(), []
    for i, c in enumerate(text):
        new = stream.feed(c)
        pieces += new
        if i == text.index('"parameters"') + len('"parameters": '):  # the first call's arguments begin
            assert isinstance(pieces[0], CallStart) and pieces[0].call.name == "get_weather"
    assert [(c.name, c.arguments) for c in collect(pieces)[1]] == [("get_weather", '{"city": "Ro}m\\"e"}'), ("ping", "{}")]
    assert [(c.name, c.arguments) for c in forced_calls(text, "required")] == [(c.name, c.arguments) for c in collect(pieces)[1]]


FRAGMENTS = [
    "Sure.", " ", "\n", "a < b", "<tool", "<tool_call>", "</tool_call>", '{"name": "ping", "arguments": {}}',
    '{"name": "get_weather", "arguments": {"city": "Rome"}}', '{"name": "rm", "arguments": {}}', "{broken",
    '{"name": "ping", "parameters": {}}', ";", "[TOOL_CALLS]", '[{"name": "ping", "arguments": {}}]', "ping{}",
    "[ping()]", '[get_weather(city="Paris")]', "<|python_tag|>", "<think>", "</think>", "</thi", "x",
    '{"name": "get_weather", "arguments": {"city": ', '"Paris"}}', "}",
]  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=8),
    parser=st.sampled_from(["hermes", "llama3_json", "mistral", "pythonic"]),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_a_stream_and_the_whole_text_always_agree(parts, parser, cuts):
    """However the output is cut into deltas, the stream's content, calls and reasoning are
    the plain answer's (the plain answer is the stream fed the whole text); with no calls the
    content is the text itself."""
    from rayserve_paged.engine.reasoning import ReasoningStream, parse_reasoning

    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    content, calls = parse_tool_calls(parser, text, TOOLS)
    stream = ToolCallStream(parser, TOOLS)
    streamed = collect([p for d in deltas for p in stream.feed(d)] + stream.finish())
    assert streamed[0] == (content if calls else text or None)
    assert [(c.name, c.arguments) for c in streamed[1]] == [(c.name, c.arguments) for c in calls]
    if not calls:
        assert content == text
    thinking = ReasoningStream()
    pieces = [thinking.feed(d) for d in deltas] + [thinking.finish()]
    reasoning, after = parse_reasoning(text)
    assert ("".join(r for r, _ in pieces) or None, "".join(c for _, c in pieces) or None) == (reasoning, after)
