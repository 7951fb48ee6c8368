"""Incremental detokenization: each new token decodes only a short window of token strings.

    tokens_text  [... prompt tail ...| out0 | out1 | ... | new ]
                  ^prefix_offset      ^read_offset
    text of window [prefix_offset:] minus text of [prefix_offset:read_offset] = the new text,
held back while it ends in an incomplete UTF-8 sequence (U+FFFD).

It runs where the outputs are consumed (the replica, or LLM's process), never in the step
loop: the engine emits token ids only.
"""

from __future__ import annotations

from dataclasses import dataclass

_PROMPT_CONTEXT = 5  # prompt tokens kept as left context (spacing of the first output word)
_MAX_KEPT = 64  # token strings before the window kept at most (per sequence memory stays flat)


@dataclass(slots=True)
class DecodeState:
    """One sequence's detokenization window."""

    tokens_text: list[str]
    prefix_offset: int
    read_offset: int


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # (skip_special_tokens, token id) -> its token strings: the tokenizer's own lookup costs
        # tens of microseconds per call, a dict hit well under one; bounded by twice the vocab
        self._pieces: dict[tuple[bool, int], list[str]] = {}

    def _token_pieces(self, token_id: int, skip_special_tokens: bool) -> list[str]:
        key = (skip_special_tokens, token_id)
        pieces = self._pieces.get(key)
        if pieces is None:
            converted = self.tokenizer.convert_ids_to_tokens([token_id], skip_special_tokens=skip_special_tokens)
            pieces = self._pieces[key] = [p for p in converted if p is not None]  # ids past the vocab: no text
        return pieces

    def start(self, prompt_token_ids: list[int], skip_special_tokens: bool) -> DecodeState:
        tail = prompt_token_ids[-_PROMPT_CONTEXT:]
        pieces = self.tokenizer.convert_ids_to_tokens(tail, skip_special_tokens=skip_special_tokens)
        tokens_text = [p for p in pieces if p is not None]
        return DecodeState(tokens_text, 0, len(tokens_text))

    def decode_next(self, state: DecodeState, token_id: int, skip_special_tokens: bool) -> str:
        """The text `token_id` adds after the tokens already decoded into `state`."""
        pieces = self._token_pieces(token_id, skip_special_tokens)
        if not pieces:
            return ""
        state.tokens_text.extend(pieces)
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(state.tokens_text[state.prefix_offset : state.read_offset])
        window_text = convert(state.tokens_text[state.prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        state.prefix_offset = state.read_offset
        state.read_offset = len(state.tokens_text)
        if state.prefix_offset > _MAX_KEPT:  # only the window is read again: drop the rest
            del state.tokens_text[: state.prefix_offset]
            state.read_offset -= state.prefix_offset
            state.prefix_offset = 0
        return window_text[len(prefix_text) :]

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
