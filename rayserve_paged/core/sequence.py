"""Sequences, request groups and the internal sampling parameters.

A request is a `SequenceGroup`: one prompt and one or more `Sequence`s that share it
(parallel samples, beam candidates). The scheduler moves whole groups between its queues;
the block manager keeps one block table per sequence.
"""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import dataclass, field

from rayserve_paged.core.lora import LoRARequest


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token id or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max model length
    FINISHED_ABORTED = "finished_aborted"  # client went away / aborted
    FINISHED_IGNORED = "finished_ignored"  # could never be scheduled (prompt too long)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_IGNORED,
    }
)

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


# stop_reason of a sequence ended with finish_reason "length" because its group could not
# grow even with every other request preempted: the KV pool, not max_tokens, was the limit.
KV_CACHE_LIMIT = "kv_cache_limit"

# stop_reason of a sequence a grammar error ended (finish_reason "abort", vLLM's word for a
# request ended by the server): "grammar_error: <what llguidance or the budget said>". Its
# output so far met the constraint; it is not complete.
GRAMMAR_ERROR = "grammar_error"


def grammar_error(message: str) -> str:
    """The stop_reason of a sequence ended by a grammar error."""
    return f"{GRAMMAR_ERROR}: {message}"


def is_grammar_error(stop_reason: object) -> bool:
    return isinstance(stop_reason, str) and stop_reason.startswith(GRAMMAR_ERROR + ":")


class SamplingParamsError(ValueError):
    """Invalid sampling parameters; the message names the field."""


MAX_PRIORITY = 2**31 - 1  # |priority| at most this (a bounded key; vLLM takes any int)

STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM's options of a JSON constraint (its StructuredOutputsParams fields)
STRUCTURED_OUTPUT_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")
# nesting of a JSON schema (objects and arrays, as JSON text nests): below llguidance's own
# limit (128, its JSON parser's) and far below Python's recursion limit
MAX_SCHEMA_DEPTH = 100


def json_depth(value: object) -> int:
    """How deeply a JSON value nests (a scalar: 0; {} or []: 1). A stack, not recursion:
    the depth is the client's choice."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item)
    return deepest


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_text_depth(text: str) -> int:
    """How deeply JSON text nests, read off its brackets outside strings (json_depth's count)
    without parsing: the parser's recursion limit depends on the caller's stack, this does not."""
    deepest = depth = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _check_schema_depth(depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise SamplingParamsError(
            f"structured_outputs.json: the schema nests {depth} levels deep, past the limit of {MAX_SCHEMA_DEPTH}"
        )


def _without_additional_properties(schema: object) -> object:
    """vLLM's disable_additional_properties: every object schema that does not say
    otherwise gets "additionalProperties": false (on a copy)."""
    schema = json.loads(json.dumps(schema))
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if (item.get("type") == "object" or "properties" in item) and "additionalProperties" not in item:
                item["additionalProperties"] = False
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return schema


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `structured_outputs`): exactly one of a JSON schema
    (`json`), any JSON object (`json_object`), a regular expression, a list of choices or a
    grammar (Lark, or GBNF / EBNF as llama.cpp writes it). The engine compiles it into a
    token-level matcher; `key` names the compiled grammar in the cache.

    `after_token_id`: the constraint applies only after this token has been generated (a
    reasoning model's end-of-thinking token: the model thinks freely first); None: from
    the first token."""

    json: str | dict | bool | None = None  # a JSON schema (dict, or its JSON text)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    # JSON only (vLLM's options): no whitespace at all between tokens (the default already
    # allows none but one space after ',' and ':'); objects take no properties but theirs
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    after_token_id: int | None = None

    def __post_init__(self) -> None:
        after = self.after_token_id
        if after is not None and (not isinstance(after, int) or isinstance(after, bool) or after < 0):
            raise SamplingParamsError(f"structured_outputs.after_token_id: a token id is required (got {after!r})")
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                f"structured_outputs: give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} (got {given or 'none'})"
            )
        for name in STRUCTURED_OUTPUT_OPTIONS:
            value = getattr(self, name)
            if value is not True and value is not False:
                raise SamplingParamsError(f"structured_outputs.{name}: must be true or false")
            if value and given[0] not in ("json", "json_object"):
                raise SamplingParamsError(
                    f"structured_outputs.{name}: applies to a JSON constraint (json, json_object), not {given[0]}"
                )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                _check_schema_depth(json_text_depth(schema))
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError) as e:
                    why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
                    raise SamplingParamsError(f"structured_outputs.json: not valid JSON ({why})") from None
            if not isinstance(schema, (dict, bool)):
                raise SamplingParamsError("structured_outputs.json: a JSON schema is an object or a boolean")
            _check_schema_depth(json_depth(schema))
            if self.disable_additional_properties:
                schema = _without_additional_properties(schema)
            object.__setattr__(self, "json", json.dumps(schema, separators=(",", ":")))
        if self.json_object is not False and self.json_object is not True:
            raise SamplingParamsError("structured_outputs.json_object: must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"structured_outputs.{name}: must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) or not self.choice:
                raise SamplingParamsError("structured_outputs.choice: must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        kind, text = self.key
        if kind == "json":
            text = json.dumps(json.loads(text), ensure_ascii=False)
        elif kind == "choice":
            text = "".join(self.choice)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise SamplingParamsError(
                f"structured_outputs.{kind}: must be valid Unicode (a lone surrogate U+{ord(e.object[e.start]):04X})"
            ) from None

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "choice":
            return kind, json.dumps(list(value))
        return kind, "" if kind == "json_object" else value

    @property
    def cache_key(self) -> tuple:
        """What makes a compiled grammar: the key and the options."""
        return (*self.key, self.disable_any_whitespace, self.disable_additional_properties)

    @property
    def num_chars(self) -> int:
        return len(self.key[1])


POOLING_TYPES = ("last", "mean", "cls")


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """A pooling (embedding) request: its prompt is prefilled and one vector comes back,
    the final hidden states pooled (`last` token, `mean` over the prompt, or the first,
    `cls`), cut to its first `dimensions` and then scaled to unit length when `normalize`;
    nothing is sampled and no KV stays after it."""

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise SamplingParamsError(f"pooling: one of {', '.join(POOLING_TYPES)} (got {self.pooling!r})")
        if not isinstance(self.normalize, bool):
            raise SamplingParamsError(f"normalize: must be a boolean (got {self.normalize!r})")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise SamplingParamsError(f"dimensions: must be an integer >= 1 (got {self.dimensions!r})")


@dataclass(slots=True)
class SamplingParams:
    """How to decode one request (the vLLM / OpenAI vocabulary).

    `n` outputs are returned; `best_of` (>= n) are generated and the n with the highest
    cumulative log-probability are kept. With `use_beam_search` the beam width is `best_of`.
    """

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # k: every prompt token after the first gets its logprob and the k most likely
    # alternatives, from the prefill's logits (vLLM's `prompt_logprobs`); such a request
    # skips the prefix-cache lookup, so its whole prompt is prefilled (its blocks are still
    # cached for others)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    # keys the prefix cache: a request reuses cached blocks only of requests with the same
    # salt (None: the shared, unsalted cache), vLLM's `cache_salt`
    cache_salt: str | None = None
    # a constraint on the output (JSON schema, regex, choice, grammar); None: free text
    structured_outputs: StructuredOutputsParams | None = None
    # under scheduling_policy "priority": lower is more urgent (admitted first, preempted
    # last); ignored under "fcfs" (vLLM's `priority`)
    priority: int = 0
    # a pooling request (PoolingParams): the prompt's pooled hidden state instead of tokens
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - set(STRUCTURED_OUTPUT_KINDS) - set(STRUCTURED_OUTPUT_OPTIONS))
            if unknown:
                raise SamplingParamsError(f"structured_outputs.{unknown[0]}: unknown constraint")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name}: {why} (got {getattr(self, name)!r})")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _is_int(self.best_of) or self.best_of < self.n:
            raise bad("best_of", f"must be an integer >= n ({self.n})")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (disabled) or an integer >= 1")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2 <= value <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be an integer >= 0")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not all(_is_int(t) and t >= 0 and _is_finite(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()):
            raise bad("logit_bias", "must map token ids >= 0 to biases in [-100, 100]")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", "must be a non-empty string")
        if not _is_int(self.priority) or not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise bad("priority", f"must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not _is_finite(self.length_penalty) or not -10 <= self.length_penalty <= 10:
            raise bad("length_penalty", "must be in [-10, 10]")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", "must be true, false or 'never'")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs: must be StructuredOutputsParams or a dict of its fields")
        if self.use_beam_search:
            if self.structured_outputs is not None:
                raise SamplingParamsError("structured_outputs: beam search cannot be combined with a constraint")
            if self.best_of < 2:
                raise bad("best_of", "beam search needs a beam width (best_of or n) >= 2")
            if self.temperature > 1e-5:
                raise bad("temperature", "beam search is deterministic: set temperature 0")
            if self.top_p < 1 or self.top_k != -1 or self.min_p > 0:
                raise bad("top_p", "beam search cannot be combined with top_p/top_k/min_p")
            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
                if getattr(self, name) != (1.0 if name == "repetition_penalty" else 0.0):
                    raise bad(name, "beam search cannot be combined with presence/frequency/repetition penalties")
        elif self.is_greedy and self.best_of > 1:
            raise bad("best_of", "greedy sampling (temperature 0) with best_of > 1 gives copies")
        if self.pooling is not None:
            if not isinstance(self.pooling, PoolingParams):
                raise SamplingParamsError("pooling: must be PoolingParams")
            if self.best_of > 1 or self.use_beam_search or self.structured_outputs is not None:
                raise bad("n", "a pooling request returns one vector: n, best_of 1, no beams, no constraint")

    @property
    def is_full_prefill(self) -> bool:
        """Whether every prompt token must be computed by the request itself (its prompt
        logprobs or its pooled hidden states need them): no prefix-cache lookup."""
        return self.prompt_logprobs is not None or self.pooling is not None

    @property
    def needs_history(self) -> bool:
        """Whether sampling needs the sequence's past tokens (the penalties do)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def beam_width(self) -> int:
        return self.best_of if self.use_beam_search else 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Sequence:
    """One token stream: the shared prompt plus this sequence's own output tokens.

    `num_computed_tokens` counts the leading tokens whose K/V are in the cache (or will be
    once the step that scheduled them has run); the rest are computed by the next step.
    """

    __slots__ = (
        "seq_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "status",
        "cumulative_logprob",
        "output_logprobs",
        "stop_reason",
        "num_blocks_sent",
        "is_on_workers",
        "draft_record",
    )

    def __init__(self, seq_id: int, prompt_token_ids: list[int]) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.output_logprobs: list = []
        self.stop_reason: int | str | None = None
        # leading entries of its block table the workers hold as they are (the scheduler's
        # bookkeeping for block-table updates in the step message)
        self.num_blocks_sent = 0
        # whether the workers hold this sequence's state (sent as a new request's first
        # sequence or as a fork, not yet released): the scheduler's bookkeeping
        self.is_on_workers = False
        # speculative decoding: its recent acceptance (core/spec_decode.py DraftRecord), made
        # by the scheduler when it first may draft
        self.draft_record = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, logprob: float = 0.0) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def fork(self, seq_id: int) -> Sequence:
        child = Sequence.__new__(Sequence)
        child.seq_id = seq_id
        child.token_ids = list(self.token_ids)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.output_logprobs = list(self.output_logprobs)
        child.stop_reason = self.stop_reason
        child.num_blocks_sent = self.num_blocks_sent  # workers fork the parent's table
        child.is_on_workers = False  # until the scheduler sends the fork
        child.draft_record = None
        return child

    def reset_for_recompute(self) -> None:
        """Preempted by recomputation: every token (prompt and output) is prefilled again."""
        self.num_computed_tokens = 0
        self.num_blocks_sent = 0
        self.status = SequenceStatus.WAITING

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )


class SequenceGroup:
    """A request: sequences that share one prompt, scheduled all-or-nothing."""

    __slots__ = (
        "request_id", "seqs", "sampling_params", "arrival_time", "arrival_index", "metrics", "is_prefilling",
        "lora_request", "has_lora_slot",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float,
        arrival_index: int,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        # FCFS order: a strictly increasing admission number (ties of arrival_time are common).
        self.arrival_index = arrival_index
        self.metrics: dict[str, float] = {}
        # Admitted, with prompt (or recomputed) tokens still to prefill in later chunks.
        self.is_prefilling = False
        self.lora_request = lora_request  # its adapter (None: the base model)
        self.has_lora_slot = False  # it pins its adapter's device slot (core/lora.py)

    @property
    def lora_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def lora_key(self):
        """Its adapter's identity (core/lora.LoRAKey); None for the base model."""
        return None if self.lora_request is None else self.lora_request.key

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status is status]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.is_finished]

    def num_unfinished_seqs(self) -> int:
        return sum(1 for s in self.seqs if not s.status.is_finished)

    def max_num_running_seqs(self) -> int:
        """Sequences this group will hold at its widest (a fresh group forks to best_of)."""
        if len(self.seqs) == 1 and self.seqs[0].num_output_tokens == 0:
            return self.sampling_params.best_of
        return self.num_unfinished_seqs()

    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={self.seqs})"
