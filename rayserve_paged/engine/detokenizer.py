"""Incremental detokenization: each new token's text, held back while it ends in an
incomplete UTF-8 sequence (U+FFFD).

With a fast tokenizer (one backed by the `tokenizers` library) a sequence decodes through
that library's `DecodeStream`: one call into Rust per token (about 0.5 us here, against
6-8 us for the token-string window below). The window stays for tokenizers without a Rust
backend and for a prompt whose last tokens end inside a character (token-id prompts), where
`DecodeStream` would re-emit the prompt's partial character:

    tokens_text  [... prompt tail ...| out0 | out1 | ... | new ]
                  ^prefix_offset      ^read_offset
    text of window [prefix_offset:] minus text of [prefix_offset:read_offset] = the new text.

Both keep the last prompt tokens as left context (the spacing of the first output word).
It runs where the outputs are consumed (the replica, or LLM's process), never in the step
loop: the engine emits token ids only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

try:
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers ships with transformers
    Tokenizer = DecodeStream = None

_PROMPT_CONTEXT = 5  # prompt tokens kept as left context (spacing of the first output word)
_MAX_KEPT = 64  # token strings before the window kept at most (per sequence memory stays flat)


@dataclass(slots=True)
class DecodeState:
    """One sequence's detokenization state: a `DecodeStream` (with the ids of its window,
    `tokens_text` empty), or the token-string window (`ids` empty)."""

    tokens_text: list[str]
    prefix_offset: int
    read_offset: int
    stream: DecodeStream | None = None
    ids: list[int] | None = None


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if DecodeStream is not None and isinstance(backend, Tokenizer) else None
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
        tail = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        backend = self._backend
        if backend is not None and not backend.decode(tail, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            return DecodeState([], 0, len(tail), DecodeStream(tail, skip_special_tokens), tail)
        pieces = self.tokenizer.convert_ids_to_tokens(tail, skip_special_tokens=skip_special_tokens)
        tokens_text = [p for p in pieces if p is not None]
        return DecodeState(tokens_text, 0, len(tokens_text))

    def copy(self, state: DecodeState) -> DecodeState:
        """An independent state that continues from `state` (a beam's fork)."""
        if state.stream is None:
            return DecodeState(list(state.tokens_text), state.prefix_offset, state.read_offset)
        return DecodeState([], state.prefix_offset, state.read_offset, copy.copy(state.stream), list(state.ids))

    def decode_next(self, state: DecodeState, token_id: int, skip_special_tokens: bool) -> str:
        """The text `token_id` adds after the tokens already decoded into `state`."""
        if state.stream is not None:
            try:
                text = state.stream.step(self._backend, token_id)
            except Exception:  # invalid bytes made its window's text no prefix of the next
                self._to_window(state, skip_special_tokens)
            else:
                ids = state.ids
                ids.append(token_id)
                if text is None:
                    return ""
                _advance(state, len(ids))
                return text
        pieces = self._token_pieces(token_id, skip_special_tokens)
        if not pieces:
            return ""
        state.tokens_text.extend(pieces)
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(state.tokens_text[state.prefix_offset : state.read_offset])
        window_text = convert(state.tokens_text[state.prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        _advance(state, len(state.tokens_text))
        return window_text[len(prefix_text) :]

    def _to_window(self, state: DecodeState, skip_special_tokens: bool) -> None:
        """Continue `state` as the token-string window over the same ids and offsets (the
        text the window gives where DecodeStream refuses: an invalid byte sequence)."""
        convert = self.tokenizer.convert_ids_to_tokens
        ids = state.ids

        def pieces(token_ids: list[int]) -> list[str]:
            return [p for p in convert(token_ids, skip_special_tokens=skip_special_tokens) if p is not None]

        state.tokens_text = pieces(ids)
        state.prefix_offset = len(pieces(ids[: state.prefix_offset]))
        state.read_offset = len(pieces(ids[: state.read_offset]))
        state.stream = state.ids = None

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _advance(state: DecodeState, num_tokens: int) -> None:
    """Text was emitted: the window moves past it (both paths keep the same offsets)."""
    state.prefix_offset = state.read_offset
    state.read_offset = num_tokens
    if state.prefix_offset > _MAX_KEPT:  # only the window is read again: drop the rest
        kept = state.ids if state.stream is not None else state.tokens_text
        del kept[: state.prefix_offset]
        state.read_offset -= state.prefix_offset
        state.prefix_offset = 0
