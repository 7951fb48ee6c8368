"""Logprobs as OpenAI writes them: each token's own text (and bytes), cached per replica,
and the completions and chat shapes built from them."""

from __future__ import annotations

import re

from rayserve_paged.deployments.protocol import ChatLogprobs, ChatLogprobToken, CompletionLogprobs, TopLogprob


class TokenTexts:
    """Each token's own text for logprobs, cached.

    A token that is only part of a UTF-8 character decodes to U+FFFD on its own; OpenAI
    writes such a token as "bytes:\\xe2\\x80". Its bytes come from the byte-level BPE
    alphabet (GPT-2's byte -> printable character map) or a "<0xNN>" byte-fallback piece.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._get(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._get(token_id)[1]

    def _get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._describe(token_id)
        return found

    def _describe(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode())
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        data = _raw_token_bytes(raw) if isinstance(raw, str) else None
        if data is None:
            return text, list(text.encode())
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data


def completion_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """OpenAI completions logprobs for these tokens, and the text offset after them."""
    result = CompletionLogprobs()
    for token_id, top in zip(token_ids, logprobs):
        token = texts.text(token_id)
        result.tokens.append(token)
        result.token_logprobs.append(top.get(token_id))
        alternatives = {texts.text(t): lp for t, lp in top.items() if t != token_id}
        result.top_logprobs.append(alternatives | {token: top.get(token_id)})  # on a text clash the sampled wins
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result, text_offset


def chat_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int
) -> ChatLogprobs:
    """OpenAI chat logprobs for these tokens, each with its `num_top` best alternatives."""
    content = []
    for token_id, top in zip(token_ids, logprobs):
        best = sorted(top.items(), key=lambda item: item[1], reverse=True)[:num_top]
        content.append(
            ChatLogprobToken(
                token=texts.text(token_id),
                logprob=top.get(token_id, float("-inf")),
                bytes=texts.bytes(token_id),
                top_logprobs=[TopLogprob(token=texts.text(t), logprob=lp, bytes=texts.bytes(t)) for t, lp in best],
            )
        )
    return ChatLogprobs(content=content)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand
    for themselves, the other bytes take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    alphabet = {chr(b): b for b in printable}
    extra = (b for b in range(256) if b not in set(printable))
    alphabet.update({chr(256 + i): b for i, b in enumerate(extra)})
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _raw_token_bytes(raw: str) -> list[int] | None:
    match = _BYTE_PIECE.match(raw)
    if match:
        return [int(match.group(1), 16)]
    if raw and all(ch in _BYTE_LEVEL for ch in raw):
        return [_BYTE_LEVEL[ch] for ch in raw]
    return None
