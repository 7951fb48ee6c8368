"""Structured outputs: constraints compiled into token-level matchers, one per sequence.

The grammar work is llguidance's (a Rust library with an abi3 wheel and no Python
dependencies; it takes JSON schemas, regexes, Lark and GBNF grammars and computes a token
bitmask per step in tens of microseconds). This module is the glue:

    caller (off the step loop)
        GrammarCompiler.submit(constraint)      compile threads; cache keyed by the
            │                                   constraint's canonical text, bounded by
            ▼ a CompiledGrammar                 entries and bytes
        compiled.new_matcher()                  the request's own matcher, handed to
                                                add_request with it
    step thread
        StructuredOutputs.fill(seq_ids)         the constrained sampled rows' bitmasks,
                                                packed into the StepMessage; a row whose
                                                matcher fails, or whose masks cost past the
                                                budget, is a grammar error
        StructuredOutputs.accept(seq, token)    the matcher consumes the sampled token

The step thread never compiles and never waits for a compile: the matcher travels with the
request, and a request without one fails at once (LLMEngine.add_request). Matchers live in
the engine's process (the scheduler's), next to the sequences whose tokens they follow: the
workers get only the bitmasks of the rows that need one, and rank 0 applies them to the
logits before sampling. A fork (n, best_of) copies its parent's matcher; preemption changes
nothing (recompute re-prefills tokens that were already sampled and consumed, it samples
none of them again).

A limit of llguidance's (its fuel, items, lexer states) is the request's outcome, never its
silence: the sequence ends with finish_reason "abort" and a stop_reason naming the grammar
error (core/sequence.py GRAMMAR_ERROR), and `num_errors` counts it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import llguidance
import numpy as np

from rayserve_paged.core.sequence import SamplingParamsError, StructuredOutputsParams, grammar_error

logger = logging.getLogger(__name__)

# JSON is generated compact, with one space after ',' and ':' (as json.dumps writes it):
# free whitespace would let a model pad its output with blanks until max_tokens.
# disable_any_whitespace (vLLM's option) drops those spaces too.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OPTIONS_NO_SPACE = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MAX_CONSTRAINT_CHARS = 65_536  # a constraint's canonical text (schema, regex, grammar, choices)
COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped first) ...
CACHE_BYTES = 256 * 2**20  # ... and the bytes they may hold together
COMPILE_THREADS = 2  # compiles at once
MAX_ABANDONED = 2  # compiles past the timeout that may still run on (their threads no longer count)
# llguidance's limits, tighter than its defaults (in brackets); its speeds in its docs
PARSER_LIMITS = {
    "initial_lexer_fuel": 200_000,  # (1M) regex analysis when the grammar is built: ~4 ms
    "step_lexer_fuel": 100_000,  # (200k) lexer work in one mask: ~7 ms
    "step_max_items": 20_000,  # (50k) Earley items in one mask or forced run: ~1 ms
    "max_lexer_states": 20_000,  # (250k) ~1-2 kB each: at most ~40 MB per grammar
    "max_grammar_size": 100_000,  # (500k) symbols in the grammar's productions
}
# a sequence whose mask costs more than this on average (CPU time of the step thread,
# moving average: each step weighs MASK_AVERAGE_WEIGHT) ends with a grammar error
MASK_BUDGET_MS = 5.0
MASK_AVERAGE_WEIGHT = 0.25


def json_options(constraint: StructuredOutputsParams) -> dict:
    return JSON_OPTIONS_NO_SPACE if constraint.disable_any_whitespace else JSON_OPTIONS


def grammar_text(constraint: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (compiled and checked by LLMatcher)."""
    kind = constraint.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(constraint.json, defaults=json_options(constraint))
        if kind == "json_object":
            schema = {"type": "object"}
            if constraint.disable_additional_properties:
                schema["additionalProperties"] = False
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_options(constraint))
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
    kept = [line for line in kept if line != "<non-verbose/>"]
    return " ".join(kept)[:500]


def _resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(slots=True)
class CompiledGrammar:
    """A compiled constraint: its template matcher (the initial state) and what it cost.
    `num_bytes` estimates what it holds: the process's resident-memory growth while it was
    built (llguidance reports no sizes), at least the constraint's text."""

    template: llguidance.LLMatcher
    num_bytes: int
    compile_s: float

    def new_matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (a copy of the template: microseconds)."""
        return self.template.deep_copy()


@dataclass(slots=True, eq=False)
class _Job:
    future: Future
    constraint: StructuredOutputsParams
    is_abandoned: bool = False


class _CompileThreads:
    """Compiles run on their own threads, at most `num_threads` at once (the rest queue).
    A compile past its caller's timeout is abandoned (llguidance cannot be interrupted):
    its thread runs on but no longer takes a place, so it cannot starve other requests'
    compiles; at most `max_abandoned` such threads may run, past that new compiles queue."""

    def __init__(self, compile_fn: Callable, num_threads: int, max_abandoned: int) -> None:
        self._compile = compile_fn
        self.num_threads = num_threads
        self.max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._running: dict[Future, _Job] = {}
        self.num_active = 0  # running, not abandoned
        self.num_abandoned = 0  # abandoned, still running
        self.thread_ids: set[int] = set()  # every compile thread's id (what tests check)
        self._closed = False

    def submit(self, constraint: StructuredOutputsParams) -> Future:
        job = _Job(Future(), constraint)
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            self._queue.append(job)
            self._start_ready()
        return job.future

    def abandon(self, future: Future) -> None:
        """The caller gave up on this compile: dequeue it, or stop counting its thread."""
        with self._lock:
            job = self._running.get(future)
            if job is None:
                for queued in self._queue:
                    if queued.future is future:
                        self._queue.remove(queued)
                        future.cancel()
                        break
                return
            if not job.is_abandoned:
                job.is_abandoned = True
                self.num_active -= 1
                self.num_abandoned += 1
                self._start_ready()

    def _start_ready(self) -> None:  # under the lock
        while self._queue and self.num_active < self.num_threads and self.num_abandoned <= self.max_abandoned:
            job = self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue
            self._running[job.future] = job
            self.num_active += 1
            threading.Thread(target=self._run, args=(job,), name="grammar-compile", daemon=True).start()

    def _run(self, job: _Job) -> None:
        self.thread_ids.add(threading.get_ident())
        try:
            result = self._compile(job.constraint)
        except BaseException as e:  # the caller's error (SamplingParamsError) or the library's
            job.future.set_exception(e)
        else:
            job.future.set_result(result)
        finally:
            with self._lock:
                del self._running[job.future]
                if job.is_abandoned:
                    self.num_abandoned -= 1
                else:
                    self.num_active -= 1
                self._start_ready()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()


class GrammarCompiler:
    """Compiles constraints off the step loop, once per distinct constraint.

    `submit` returns a future of the constraint's CompiledGrammar; `compile` waits for it
    (at most `timeout_s`; past it the compile is abandoned and dropped from the cache). An
    invalid constraint is a SamplingParamsError naming its field; so is a compile past the
    limit, and a constraint that fails at its first token (no finite output: a required
    recursion, a grammar that only repeats; or past the parser limits). The cache keeps
    only grammars that compiled, within `cache_size` entries and `cache_bytes` bytes.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        max_workers: int = COMPILE_THREADS,
        timeout_s: float = COMPILE_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
        max_chars: int = MAX_CONSTRAINT_CHARS,
        load_tokenizer: Callable[[], object] | None = None,
        cache_bytes: int = CACHE_BYTES,
        max_abandoned: int = MAX_ABANDONED,
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
        self.cache_bytes = cache_bytes
        self.max_chars = max_chars
        self.num_words = 0  # int32 words of one bitmask, once the tokenizer is built
        self.threads = _CompileThreads(lambda c: self._compile(c), max_workers, max_abandoned)
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self.num_cached_bytes = 0  # of the compiled entries in the cache
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
        """The future CompiledGrammar of this constraint (a cached one, or a new compile)."""
        self.check(constraint)
        key = constraint.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            future = self.threads.submit(constraint)
            self._cache[key] = future
            self._evict()
        future.add_done_callback(lambda f: self._on_done(key, f))  # outside the lock: it may run now
        return future

    def _on_done(self, key: tuple, future: Future) -> None:
        """A compile ended: a failed one leaves the cache; a good one counts its bytes."""
        with self._lock:
            if self._cache.get(key) is not future:  # evicted or abandoned meanwhile
                return
            if future.cancelled() or future.exception() is not None:
                del self._cache[key]
                return
            self.num_cached_bytes += future.result().num_bytes
            self._evict()

    def _evict(self) -> None:  # under the lock
        while len(self._cache) > self.cache_size or (self.num_cached_bytes > self.cache_bytes and len(self._cache) > 1):
            self._drop(next(iter(self._cache)))

    def _drop(self, key: tuple) -> None:  # under the lock
        future = self._cache.pop(key)
        if future.done() and not future.cancelled() and future.exception() is None:
            self.num_cached_bytes -= future.result().num_bytes

    def give_up(self, constraint: StructuredOutputsParams, future: Future) -> SamplingParamsError:
        """The caller waited `timeout_s` for `future`: the compile is abandoned and not
        cached; the error to answer with."""
        with self._lock:
            key = constraint.cache_key
            if self._cache.get(key) is future:
                self._drop(key)
        self.threads.abandon(future)
        return SamplingParamsError(
            f"structured_outputs.{constraint.kind}: compiling took longer than {self.timeout_s:g} s"
        )

    def discard(self, constraint: StructuredOutputsParams) -> None:
        """Drop a grammar that failed while in use: its copies share its lexer, whose state
        limit it has met, so later requests would fail sooner; a new compile starts fresh."""
        with self._lock:
            if constraint.cache_key in self._cache:
                self._drop(constraint.cache_key)

    def compile(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, waiting for it here (never on the step thread)."""
        future = self.submit(constraint)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self.give_up(constraint, future) from None

    def cached(self, constraint: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled constraint if the cache holds it compiled; never waits."""
        with self._lock:
            future = self._cache.get(constraint.cache_key)
        if future is None or not future.done() or future.cancelled() or future.exception() is not None:
            return None
        return future.result()

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

    def _compile(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        self.num_compiles += 1
        field = f"structured_outputs.{constraint.kind}"
        tokenizer = self.ll_tokenizer()  # outside the measured bytes: built once
        start, before = time.perf_counter(), _resident_bytes()
        grammar = grammar_text(constraint)
        try:
            # verbose_errors off: a message names the problem, not the parser's state
            limits = llguidance.LLParserLimits(verbose_errors=False, **PARSER_LIMITS)
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        except Exception as e:  # the library documents none for bad grammars: still the caller's error
            raise SamplingParamsError(f"{field}: {_first_line(e)}") from None
        if matcher.is_error():
            raise SamplingParamsError(f"{field}: {_first_line(matcher.get_error())}")
        self._probe(matcher, field)
        num_bytes = max(_resident_bytes() - before, constraint.num_chars)
        return CompiledGrammar(matcher, num_bytes, time.perf_counter() - start)

    def _probe(self, template: llguidance.LLMatcher, field: str) -> None:
        """The cheap check that the constraint can be followed: a first mask with a token
        other than EOS in it, and a copy that takes the first such token without an error.
        A constraint that can never finish fails here: its forced continuation (a required
        recursion, `start: "a" start`) runs into the parser's item limit at once."""
        mask = np.zeros((1, self.num_words), dtype=np.int32)
        template.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if template.is_error() or not mask.any():
            raise SamplingParamsError(f"{field}: no output can match it")
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        bits[[t for t in self.eos_token_ids if t < bits.size]] = 0
        allowed = np.flatnonzero(bits)
        if allowed.size == 0:
            return  # only the empty output matches: EOS, complete
        probe = template.deep_copy()
        if not probe.consume_token(int(allowed[0])) or probe.is_error():
            raise SamplingParamsError(
                f"{field}: refused, its first token already runs past the grammar limits (a constraint whose "
                f"output can never finish, or too costly to follow): {_first_line(probe.get_error())}"
            )

    def shutdown(self) -> None:
        self.threads.shutdown()


@dataclass(slots=True)
class GrammarErrorCounters:
    """Sequences ended by a grammar error, by where it happened."""

    consume: int = 0  # the matcher refused or failed on the sampled token
    mask: int = 0  # the matcher failed while computing its mask
    mask_budget: int = 0  # its masks cost past the budget

    def items(self) -> list[tuple[str, int]]:
        return [("consume", self.consume), ("mask", self.mask), ("mask_budget", self.mask_budget)]


@dataclass(slots=True)
class _Matcher:
    matcher: llguidance.LLMatcher
    mask_s: float = 0.0  # moving average of its mask's CPU time per step


@dataclass(slots=True)
class StructuredOutputs:
    """The engine's matchers, by seq id, and the per-step bitmasks of the constrained rows."""

    compiler: GrammarCompiler
    mask_budget_s: float = MASK_BUDGET_MS / 1e3
    matchers: dict[int, _Matcher] = field(default_factory=dict)
    # constraints that start after a token (StructuredOutputsParams.after_token_id, the end
    # of a reasoning model's thinking): seq id -> (that token, the matcher it starts)
    waiting: dict[int, tuple[int, llguidance.LLMatcher]] = field(default_factory=dict)
    errors: GrammarErrorCounters = field(default_factory=GrammarErrorCounters)

    def add(self, seq_id: int, matcher: llguidance.LLMatcher, after_token_id: int | None = None) -> None:
        if after_token_id is None:
            self.matchers[seq_id] = _Matcher(matcher)
        else:
            self.waiting[seq_id] = (after_token_id, matcher)

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self.matchers.get(parent_id)
        if parent is not None:
            self.matchers[child_id] = _Matcher(parent.matcher.deep_copy(), parent.mask_s)
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
            self.matchers[seq_id] = _Matcher(self.waiting.pop(seq_id)[1])

    def fill(self, seq_ids: list[int]) -> tuple[bytes, dict[int, str]]:
        """The packed bitmasks of these (constrained) sequences, in order ([len(seq_ids),
        num_words] little-endian int32: StepMessage.token_bitmasks), and the grammar errors
        of the rows that cannot go on (seq id -> stop_reason; their rows allow every token,
        their samples are dropped). One row at a time on this thread, each timed: the
        budget is per sequence."""
        mask = np.empty((len(seq_ids), self.compiler.num_words), dtype=np.int32)
        row_bytes = mask.shape[1] * 4
        base = mask.ctypes.data
        errors: dict[int, str] = {}
        weight = MASK_AVERAGE_WEIGHT
        clock = time.thread_time
        for i, seq_id in enumerate(seq_ids):
            state = self.matchers[seq_id]
            start = clock()
            state.matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
            state.mask_s += weight * (clock() - start - state.mask_s)
            if state.matcher.is_error():
                self.errors.mask += 1
                errors[seq_id] = grammar_error(_first_line(state.matcher.get_error()))
            elif state.mask_s > self.mask_budget_s:
                self.errors.mask_budget += 1
                errors[seq_id] = grammar_error(
                    f"its masks cost {state.mask_s * 1e3:.1f} ms per step, past the budget of "
                    f"{self.mask_budget_s * 1e3:g} ms"
                )
            if seq_id in errors:
                mask[i] = -1
        return mask.astype("<i4", copy=False).tobytes(), errors

    def accept(self, seq_id: int, token_id: int) -> tuple[bool, str | None]:
        """The matcher takes the sampled token: (whether the grammar is complete, so nothing
        but EOS may follow; the grammar error that ends the sequence, or None). A matcher
        that fails is dropped; after an error nothing is complete."""
        state = self.matchers.get(seq_id)
        if state is None:
            self._start_after(seq_id, token_id)
            return False, None
        matcher = state.matcher
        if not matcher.consume_token(token_id) or matcher.is_error():
            self.errors.consume += 1
            del self.matchers[seq_id]
            return False, grammar_error(_first_line(matcher.get_error()) or f"token {token_id} refused")
        return matcher.is_stopped(), None
