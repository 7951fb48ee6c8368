"""Structured outputs: constraints compiled into token-level matchers, one per sequence.

The grammar work is llguidance's (a Rust library with an abi3 wheel and no Python
dependencies; it takes JSON schemas, regexes, Lark and GBNF grammars and computes a token
bitmask per step in tens of microseconds). This module is the glue:

    add_request ──> GrammarCompiler.submit(constraint)   thread pool, cache keyed by the
                        │                                  constraint's canonical text
                        ▼ a compiled template matcher
                    matcher(constraint) = template.deep_copy()   one per sequence
    each step   ──> StructuredOutputs.fill(step)   the constrained sampled rows' bitmasks,
                                                   packed into the StepMessage
    each token  ──> StructuredOutputs.accept(seq)  the matcher consumes the sampled token

Matchers live in the engine's process (the scheduler's), next to the sequences whose
tokens they follow: the workers get only the bitmasks of the rows that need one, and rank 0
applies them to the logits before sampling. A fork (n, best_of) copies its parent's matcher;
preemption changes nothing (recompute re-prefills tokens that were already sampled and
consumed, it samples none of them again).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from rayserve_paged.core.sequence import SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger(__name__)

# JSON is generated compact, with one space after ',' and ':' (as json.dumps writes it):
# free whitespace would let a model pad its output with blanks until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CONSTRAINT_CHARS = 65_536  # a constraint's canonical text (schema, regex, grammar, choices)
COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped first)


def grammar_text(constraint: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (compiled and checked by LLMatcher)."""
    kind = constraint.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(constraint.json, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(constraint.choice)))
        return llguidance.grammar_from("grammar", constraint.grammar)  # Lark, or GBNF converted
    except ValueError as e:
        raise SamplingParamsError(f"structured_outputs.{kind}: {_first_line(e)}") from None


def _first_line(error: object) -> str:
    """The library's message on one line (its source excerpts and carets dropped)."""
    lines = [line.strip() for line in str(error).strip().split("\n")]
    kept = [line for line in lines if line and not line.startswith("^") and "|" not in line[:6]]
    return " ".join(kept)[:500]


class GrammarCompiler:
    """Compiles constraints off the step loop, once per distinct constraint.

    `submit` returns a future of the constraint's template matcher (its initial state);
    `matcher` waits for it (at most `timeout_s`) and hands out a copy. An invalid
    constraint is a SamplingParamsError naming its field; so is a compile past the limit.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        max_workers: int = 2,
        timeout_s: float = COMPILE_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
        max_chars: int = MAX_CONSTRAINT_CHARS,
        load_tokenizer: Callable[[], object] | None = None,
    ) -> None:
        """`tokenizer`: the HF tokenizer, or None and `load_tokenizer` returns it when the
        first grammar is compiled."""
        if tokenizer is None and load_tokenizer is None:
            raise ValueError("GrammarCompiler needs a tokenizer or load_tokenizer")
        self._hf_tokenizer = tokenizer
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.max_chars = max_chars
        self.num_words = 0  # int32 words of one bitmask, once the tokenizer is built
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self.num_compiles = 0

    def check(self, constraint: StructuredOutputsParams) -> None:
        """The checks that need no compile (size)."""
        if constraint.num_chars > self.max_chars:
            raise SamplingParamsError(
                f"structured_outputs.{constraint.kind}: {constraint.num_chars} characters exceed the limit "
                f"of {self.max_chars}"
            )

    def submit(self, constraint: StructuredOutputsParams) -> Future:
        self.check(constraint)
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def matcher(self, constraint: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (waits for the compile)."""
        future = self.submit(constraint)
        try:
            template = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise SamplingParamsError(
                f"structured_outputs.{constraint.kind}: compiling took longer than {self.timeout_s:g} s"
            ) from None
        return template.deep_copy()

    @property
    def hf_tokenizer(self):
        if self._hf_tokenizer is None:
            self._hf_tokenizer = self._load_tokenizer()
        return self._hf_tokenizer

    @property
    def tokenizer_ready(self) -> bool:
        """Whether llguidance's tokenizer is built (the first compile builds it, loading the
        HF tokenizer first where the engine has not)."""
        return self._ll_tokenizer is not None

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:  # not self._lock: a submit on the caller's loop never waits for the build
            if self._ll_tokenizer is None:
                n_vocab = self.vocab_size if self.vocab_size >= len(self.hf_tokenizer) else None
                import llguidance.hf  # imports transformers: only in a process that compiles grammars

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=n_vocab, eos_token=self.eos_token_ids
                )
                self.num_words = (self._ll_tokenizer.vocab_size + 31) // 32
            return self._ll_tokenizer

    def _compile(self, constraint: StructuredOutputsParams) -> llguidance.LLMatcher:
        self.num_compiles += 1
        field = f"structured_outputs.{constraint.kind}"
        grammar = grammar_text(constraint)
        try:
            # verbose_errors off: a message names the problem, not the parser's state
            limits = llguidance.LLParserLimits(verbose_errors=False)
            matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=limits)
        except Exception as e:  # the library documents none for bad grammars: still the caller's error
            raise SamplingParamsError(f"{field}: {_first_line(e)}") from None
        if matcher.is_error():
            raise SamplingParamsError(f"{field}: {_first_line(matcher.get_error())}")
        mask = np.empty((1, self.num_words), dtype=np.int32)
        fill_next_token_bitmask(matcher, mask)
        if not mask.any() or matcher.is_error():
            raise SamplingParamsError(f"{field}: no output can match it")
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StructuredOutputs:
    """The engine's matchers, by seq id, and the per-step bitmasks of the constrained rows."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.matchers: dict[int, llguidance.LLMatcher] = {}
        # constraints that start after a token (StructuredOutputsParams.after_token_id, the end
        # of a reasoning model's thinking): seq id -> (that token, the matcher it starts)
        self.waiting: dict[int, tuple[int, llguidance.LLMatcher]] = {}
        self._executor = llguidance.LLExecutor()

    def add(self, seq_id: int, constraint: StructuredOutputsParams) -> None:
        matcher = self.compiler.matcher(constraint)
        if constraint.after_token_id is None:
            self.matchers[seq_id] = matcher
        else:
            self.waiting[seq_id] = (constraint.after_token_id, matcher)

    def fork(self, parent_id: int, child_id: int) -> None:
        matcher = self.matchers.get(parent_id)
        if matcher is not None:
            self.matchers[child_id] = matcher.deep_copy()
        if parent_id in self.waiting:
            token_id, matcher = self.waiting[parent_id]
            self.waiting[child_id] = (token_id, matcher.deep_copy())

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
        self.waiting.pop(seq_id, None)

    def _start_after(self, seq_id: int, token_id: int) -> None:
        """A waiting constraint starts once its token has been generated (no mask until then:
        only sequences in `matchers` get one)."""
        waiting = self.waiting.get(seq_id)
        if waiting is not None and waiting[0] == token_id:
            self.matchers[seq_id] = self.waiting.pop(seq_id)[1]

    def bitmasks(self, seq_ids: list[int]) -> bytes:
        """The packed bitmasks of these (constrained) sequences, in order:
        [len(seq_ids), num_words] little-endian int32 (StepMessage.token_bitmasks)."""
        mask = np.empty((len(seq_ids), self.compiler.num_words), dtype=np.int32)
        matchers = self.matchers
        fill_next_token_bitmask_par(self._executor, [(matchers[s], i) for i, s in enumerate(seq_ids)], mask)
        return mask.astype("<i4", copy=False).tobytes()

    def accept(self, seq_id: int, token_id: int) -> bool:
        """The matcher takes the sampled token; True when the grammar is complete (nothing
        but EOS may follow). A token it refuses (never sampled under its mask) is logged and
        ends the constraint for that sequence."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            self._start_after(seq_id, token_id)
            return False
        if not matcher.consume_token(token_id):
            logger.error("sequence %d: the grammar refused token %d: %s", seq_id, token_id, matcher.get_error())
            del self.matchers[seq_id]
            return False
        return matcher.is_stopped()
