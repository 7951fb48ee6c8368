"""Reasoning parsers: a thinking model's <think>...</think> text, out of the content.

    qwen3         Qwen3: the model writes <think> ... </think> then its answer (or the
                  template opens <think> in the prompt); `chat_template_kwargs:
                  {"enable_thinking": false}` turns thinking off, and then nothing is parsed
    deepseek_r1   DeepSeek-R1: the template opens <think> in the prompt, the output is the
                  reasoning up to </think>, then the answer

As vLLM's parsers of those names read them: a <think> at the start of the output is dropped;
the text up to </think> is the reasoning and what follows it the content; an output that
ends before </think> is all reasoning. A prompt that already closed the reasoning (its text
after the last </think> is only whitespace: Qwen3's template with enable_thinking false
writes "<think>\\n\\n</think>\\n\\n") leaves the whole output content.

A constraint (response_format, structured outputs, forced tool calls) applies from the end
of the reasoning: the engine starts its matcher after the </think> token
(StructuredOutputsParams.after_token_id), as vLLM's "structured outputs with reasoning".

`ReasoningStream` reads an output as it streams; the plain answer is the same reader fed
the whole text, so the two always agree. Pure Python.
"""

from __future__ import annotations

from rayserve_paged.engine.tool_calls import partial_suffix

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"


def check_reasoning_parser(parser: str) -> str:
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: expected one of {', '.join(REASONING_PARSERS)} (got {parser!r})")
    return parser


def end_token_id(tokenizer, parser: str) -> int:
    """The id of the token that ends the reasoning (the parser needs it to be one token)."""
    check_reasoning_parser(parser)
    token_id = tokenizer.convert_tokens_to_ids(THINK_END)
    if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
        raise ValueError(f"reasoning_parser {parser!r}: the tokenizer has no {THINK_END} token")
    return token_id


def is_thinking(parser: str | None, prompt: str, chat_template_kwargs: dict | None) -> bool:
    """Whether an output of this prompt begins with reasoning to parse."""
    if parser is None:
        return False
    if parser == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking", True) is False:
        return False
    end = prompt.rfind(THINK_END)
    return end == -1 or bool(prompt[end + len(THINK_END) :].strip())


class ReasoningStream:
    """`feed(text)` -> (reasoning, content) that can be sent now; `finish()` the rest."""

    def __init__(self) -> None:
        self.buf = ""
        self.is_started = False  # past a <think> at the start (or sure there is none)
        self.is_done = False  # </think> seen: the rest is content

    def feed(self, text: str) -> tuple[str, str]:
        if self.is_done:
            return "", text
        self.buf += text
        if not self.is_started:
            body = self.buf.lstrip()
            if THINK_START.startswith(body):
                return "", ""  # perhaps <think>: wait for the next piece
            self.is_started = True
            if body.startswith(THINK_START):
                self.buf = body[len(THINK_START) :]
        end = self.buf.find(THINK_END)
        if end != -1:
            reasoning, content = self.buf[:end], self.buf[end + len(THINK_END) :]
            self.buf, self.is_done = "", True
            return reasoning, content
        keep = partial_suffix(self.buf, THINK_END)
        reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        return rest, ""


def parse_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output that begins with reasoning (None when empty)."""
    stream = ReasoningStream()
    reasoning, content = stream.feed(text)
    rest, _ = stream.finish()
    return (reasoning + rest) or None, content or None

