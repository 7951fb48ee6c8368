"""Incremental detokenization: each step decodes only a short window of token strings.

    tokens_text  [... prompt tail ...| out0 | out1 | ... | new ]
                  ^prefix_offset      ^read_offset
    text of window [prefix_offset:] minus text of [prefix_offset:read_offset] = the new text,
held back while it ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from rayserve_paged.core.sequence import Sequence

_PROMPT_CONTEXT = 5  # prompt tokens kept as left context (spacing of the first output word)


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def start(self, seq: Sequence, skip_special_tokens: bool) -> None:
        tail = seq.prompt_token_ids[-_PROMPT_CONTEXT:]
        pieces = self.tokenizer.convert_ids_to_tokens(tail, skip_special_tokens=skip_special_tokens)
        seq.tokens_text = [p for p in pieces if p is not None]
        seq.prefix_offset = 0
        seq.read_offset = len(seq.tokens_text)

    def decode_next(self, seq: Sequence, token_id: int, skip_special_tokens: bool) -> str:
        """Append the text of `token_id` (just appended to `seq`) to seq.output_text; return it."""
        if seq.tokens_text is None:
            self.start(seq, skip_special_tokens)
        pieces = self.tokenizer.convert_ids_to_tokens([token_id], skip_special_tokens=skip_special_tokens)
        pieces = [p for p in pieces if p is not None]  # ids past the tokenizer's vocab have no text
        if not pieces:
            return ""
        seq.tokens_text.extend(pieces)
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(seq.tokens_text[seq.prefix_offset : seq.read_offset])
        window_text = convert(seq.tokens_text[seq.prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        new_text = window_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(seq.tokens_text)
        seq.output_text += new_text
        return new_text

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
