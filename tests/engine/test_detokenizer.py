"""The detokenizer (the `tokenizers` library's DecodeStream for fast tokenizers) against the
token-string window it replaced, kept here as the reference: every corpus text, after every
prompt, with special tokens skipped or not, gives the same text token by token; on the
tiny byte-level tokenizers, a byte-fallback (sentencepiece-style) tokenizer and smollm2's."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from rayserve_paged.engine.detokenizer import Detokenizer
from rayserve_paged.models.loader import load_tokenizer

PROMPTS = ["Hello", "日本", "Say:", "a\n", ""]
OUTPUTS = [
    " world, this is a test.",
    "語のテキスト 😀🎉 emoji 👩‍👩‍👧",
    "  spaces\n\nnewlines\t tab  ",
    " café naïve ü Ωμέγα",
    "中文字符和한국어",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓",
]


class WindowDetokenizer:
    """The detokenizer before DecodeStream, unchanged: a window of token strings."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def start(self, prompt_token_ids, skip):
        pieces = self.tokenizer.convert_ids_to_tokens(prompt_token_ids[-5:], skip_special_tokens=skip)
        tokens = [p for p in pieces if p is not None]
        return [tokens, 0, len(tokens)]

    def decode_next(self, state, token_id, skip):
        converted = self.tokenizer.convert_ids_to_tokens([token_id], skip_special_tokens=skip)
        pieces = [p for p in converted if p is not None]
        if not pieces:
            return ""
        tokens, prefix_offset, read_offset = state
        tokens.extend(pieces)
        prefix_text = self.tokenizer.convert_tokens_to_string(tokens[prefix_offset:read_offset])
        window_text = self.tokenizer.convert_tokens_to_string(tokens[prefix_offset:])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        state[1], state[2] = read_offset, len(tokens)
        return window_text[len(prefix_text) :]


def _streamed(detok, prompt_ids, output_ids, skip) -> list[str]:
    state = detok.start(prompt_ids, skip)
    return [detok.decode_next(state, i, skip) for i in output_ids]


def _cases(tokenizer, seed=0):
    """(prompt ids, output ids): encoded corpus texts, the same with special tokens and ids
    past the vocab inside, and random ids (byte tokens split anywhere)."""
    rng = random.Random(seed)
    specials = [i for i in tokenizer.all_special_ids]
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt).input_ids
        for text in OUTPUTS:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            yield prompt_ids, ids
            yield prompt_ids, ids[:3] + [rng.choice(specials)] + ids[3:] + [len(tokenizer) + 2] + [rng.choice(specials)]
        yield prompt_ids, [rng.randrange(len(tokenizer)) for _ in range(60)]


def _assert_same_as_window(tokenizer):
    new, old = Detokenizer(tokenizer), WindowDetokenizer(tokenizer)
    num_checked = 0
    for prompt_ids, output_ids in _cases(tokenizer):
        for skip in (True, False):
            got = _streamed(new, prompt_ids, output_ids, skip)
            assert got == _streamed(old, prompt_ids, output_ids, skip), (prompt_ids, output_ids, skip)
            num_checked += 1
    return new, num_checked


@pytest.fixture(scope="module")
def tiny_tokenizers(tiny_paths):
    return {arch: load_tokenizer(path, False) for arch, path in tiny_paths.items()}


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_tiny_tokenizers_stream_the_window_text(tiny_tokenizers, arch):
    detok, num_checked = _assert_same_as_window(tiny_tokenizers[arch])
    assert detok._backend is not None and num_checked == 2 * len(PROMPTS) * (2 * len(OUTPUTS) + 1)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A sentencepiece-style BPE (Metaspace, byte fallback): characters missing from its
    vocab come out as <0xNN> byte tokens, one per UTF-8 byte."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for ch in "▁abcdefghijklmnopqrstuvwxyzHSTW,.:\n\té":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("l", "l"), ("e", "ll"), ("H", "ell"), ("Hell", "o")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_byte_fallback_tokens_stream_the_window_text(byte_fallback_tokenizer):
    tokenizer = byte_fallback_tokenizer
    ids = tokenizer("語😀", add_special_tokens=False).input_ids
    assert tokenizer.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    _, num_checked = _assert_same_as_window(tokenizer)
    assert num_checked == 2 * len(PROMPTS) * (2 * len(OUTPUTS) + 1)
    # a character split across byte tokens appears whole, with its last byte
    detok = Detokenizer(tokenizer)
    state = detok.start([1], True)
    assert tokenizer.convert_ids_to_tokens(ids[:1]) == ["▁"] and len(ids) == 8
    assert [detok.decode_next(state, i, True) for i in ids] == ["", "", "", "語", "", "", "", "😀"]


def test_invalid_bytes_continue_as_the_window(byte_fallback_tokenizer):
    """Stray continuation bytes make DecodeStream refuse its own prefix: the state turns
    into the window over the same ids, with the window's text."""
    tokenizer = byte_fallback_tokenizer
    output_ids = [3 + 0x3B, 3 + 0x63, 3 + 0xF5, 293, 3 + 0x33, 263]  # 0xF5 never starts a character
    detok = Detokenizer(tokenizer)
    state = detok.start([1], True)
    got = [detok.decode_next(state, i, True) for i in output_ids]
    assert state.stream is None and state.tokens_text
    assert got == _streamed(WindowDetokenizer(tokenizer), [1], output_ids, True)


def test_prompt_ending_inside_a_character_keeps_the_window(tiny_tokenizers):
    """A token-id prompt may end inside a character: the window (today's text) decodes it."""
    tokenizer = tiny_tokenizers["opt"]
    ids = tokenizer("日本語", add_special_tokens=False).input_ids
    assert len(ids) > 3
    new, old = Detokenizer(tokenizer), WindowDetokenizer(tokenizer)
    for cut in range(1, len(ids)):
        state = new.start(ids[:cut], True)
        text = tokenizer.decode(ids[:cut])
        assert (state.stream is None) == text.endswith("\ufffd")
        assert _streamed(new, ids[:cut], ids[cut:], True) == _streamed(old, ids[:cut], ids[cut:], True)


def test_copied_state_decodes_independently(tiny_tokenizers):
    tokenizer = tiny_tokenizers["opt"]
    detok = Detokenizer(tokenizer)
    a = tokenizer(" one two", add_special_tokens=False).input_ids
    b = tokenizer(" three", add_special_tokens=False).input_ids
    state = detok.start(tokenizer("Hi").input_ids, True)
    first = "".join(detok.decode_next(state, i, True) for i in a)
    fork = detok.copy(state)
    assert "".join(detok.decode_next(fork, i, True) for i in b) == " three"
    assert "".join(detok.decode_next(state, i, True) for i in a) == " one two"
    assert first == " one two"


def test_smollm2_tokenizer_streams_the_whole_decode():
    """smollm2 marks added tokens special (<reponame>, <jupyter_script>...) that its
    tokenizer's special-token list omits: with skip_special_tokens the stream now skips
    them as tokenizer.decode of the whole sequence does (the window kept them)."""
    from transformers import AutoTokenizer

    from rayserve_paged.models.tiny import resolve_model

    gguf = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    detok, old = Detokenizer(tokenizer), WindowDetokenizer(tokenizer)
    assert detok._backend is not None
    num_differing = 0
    for prompt_ids, output_ids in _cases(tokenizer):
        for skip in (True, False):
            got = "".join(_streamed(detok, prompt_ids, output_ids, skip))
            whole = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip)
            prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip)
            assert whole.startswith(prompt_text)
            assert got == whole[len(prompt_text) :], (prompt_ids, output_ids, skip)
            if got != "".join(_streamed(old, prompt_ids, output_ids, skip)):
                num_differing += 1
                assert skip and any(tokenizer.convert_ids_to_tokens(i).startswith("<") for i in output_ids)
    assert num_differing <= 1 * len(PROMPTS)  # only the random-id cases carry such tokens
