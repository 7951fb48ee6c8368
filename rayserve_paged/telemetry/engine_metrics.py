"""Engine metrics of one replica, measured in its scheduler actor.

Gauges and counters are observable: their callbacks read the engine's own counters
(`scheduler.counters`, `block_manager.counters`, `block_manager.usage()`, the queues) when
a reader collects, so a step pays nothing for them. Only the latency histograms and the
finished-request counter are recorded, once per finished request.

The callbacks run on the collecting thread (GET /metrics, the Prometheus server, the OTLP
exporter) while the step thread mutates the engine, without a lock: each figure is one int
read (atomic under the GIL), so a collection may straddle a step but never sees a torn value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from rayserve_paged.telemetry import names


class EngineLike(Protocol):
    """What EngineMetrics reads; LLMEngine has it. Attributes, read at collection time:

    scheduler.counters.preemptions_recompute / preemptions_swap
    scheduler.waiting / running / swapped        (running may keep finished groups a step)
    block_manager.usage() -> BlockUsage          (gpu_used / gpu_cached / gpu_free / gpu_total, cpu_*)
    block_manager.slot_usage(seqs) -> (gpu, cpu) SlotUsage  (token slots of the live sequences)
    block_manager.counters                       (copy_on_write_blocks, swapped_in_blocks,
                                                  swapped_out_blocks, prefix_cache_queries/hits,
                                                  the tier counters: offload_hits, offloaded_blocks,
                                                  restored_blocks, offload_evicted_blocks,
                                                  prefix_cache_evicted_blocks)
    num_prompt_tokens, num_generation_tokens
    scheduler.counters.spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens
    scheduler.counters.spec_decode_num_draft_tokens_per_position,
    spec_decode_num_accepted_tokens_per_position  (only with speculation: scheduler.config.speculative)
    structured.errors.items(), grammars.num_cached_bytes  (grammar errors by stage, cache bytes)
    lora_slots, loras, num_lora_requests          (only with LoRA: lora_slots not None)
    """

    scheduler: Any
    block_manager: Any
    num_prompt_tokens: int
    num_generation_tokens: int


def _swapped_blocks(engine: EngineLike):
    c = engine.block_manager.counters
    return (("in", c.swapped_in_blocks), ("out", c.swapped_out_blocks))


def _tier_hits(engine: EngineLike):
    c = engine.block_manager.counters
    return (("device", c.prefix_cache_hits), ("host", c.offload_hits))


def _tier_blocks(engine: EngineLike):
    """((tier, event), blocks) pairs: what moved in and out of each prefix-cache tier."""
    c = engine.block_manager.counters
    return (
        (("device", "evicted"), c.prefix_cache_evicted_blocks),
        (("host", "offloaded"), c.offloaded_blocks),
        (("host", "restored"), c.restored_blocks),
        (("host", "evicted"), c.offload_evicted_blocks),
    )


def _preemptions(engine: EngineLike):
    c = engine.scheduler.counters
    return (("recompute", c.preemptions_recompute), ("swap", c.preemptions_swap))


def _tokens(engine: EngineLike):
    return (("prompt", engine.num_prompt_tokens), ("generation", engine.num_generation_tokens))


def _lora_adapters(engine: EngineLike):
    slots = engine.lora_slots
    return (("registered", len(engine.loras)), ("resident", len(slots.slot_of)), ("active", slots.num_pinned))


def _blocks(engine: EngineLike):
    """((pool, state), blocks) pairs of the block manager's pools."""
    u = engine.block_manager.usage()
    return (
        ((names.DEVICE_POOL, "used"), u.gpu_used),
        ((names.DEVICE_POOL, "cached"), u.gpu_cached),
        ((names.DEVICE_POOL, "free"), u.gpu_free),
        ((names.SWAP_POOL, "used"), u.cpu_used),
        ((names.SWAP_POOL, "free"), u.cpu_free),
    )


def _usage(engine: EngineLike):
    u = engine.block_manager.usage()
    return ((names.DEVICE_POOL, u.gpu_usage), (names.SWAP_POOL, u.cpu_usage))


def _slot_usage(engine: EngineLike):
    """(pool, SlotUsage) of the sequences of running and swapped groups, read now."""
    s = engine.scheduler
    seqs = [seq for group in (*list(s.running), *list(s.swapped)) for seq in list(group.seqs)]
    gpu, cpu = engine.block_manager.slot_usage(seqs)
    return ((names.DEVICE_POOL, gpu), (names.SWAP_POOL, cpu))


def _token_slots(engine: EngineLike):
    return [
        ((pool, state), n)
        for pool, u in _slot_usage(engine)
        for state, n in (("used", u.used_slots), ("allocated", u.allocated_slots))
    ]


def _fragmentation(engine: EngineLike):
    return [(pool, u.fragmentation) for pool, u in _slot_usage(engine)]


def _shared_blocks(engine: EngineLike):
    return [(pool, u.num_shared_blocks) for pool, u in _slot_usage(engine)]


def _by_position(counts: list[int]):
    return [(str(position), n) for position, n in enumerate(list(counts))]


def _requests(engine: EngineLike):
    s = engine.scheduler
    # finished groups stay in `running` until the next schedule(); count only live ones
    num_running = sum(1 for g in list(s.running) if not g.is_finished())
    return (("running", num_running), ("waiting", len(s.waiting)), ("swapped", len(s.swapped)))


@dataclass(frozen=True, slots=True)
class _Observable:
    """One observable instrument. `read` is the engine's attribute path to one value, or a
    function of the engine giving (label, value) pairs observed with attribute `key`, or
    (labels, value) pairs with a tuple of keys."""

    kind: str  # "counter", "up_down_counter" or "gauge": meter.create_observable_<kind>
    name: str
    unit: str
    read: str | Callable[[Any], Any]
    description: str
    key: str | tuple[str, ...] | None = None


_ENGINE_INSTRUMENTS = (
    # -- KV cache (the block manager's state at collection)
    _Observable("up_down_counter", names.KV_CACHE_BLOCKS, "{block}", _blocks,
        "KV cache blocks by pool (device, cpu: the swap pool) and state (used: held by sequences; "
        "cached: free but holding a reusable prefix; free).", key=(names.POOL, names.STATE)),
    _Observable("gauge", names.KV_CACHE_USAGE, "1", _usage,
        "Fraction of the pool's KV blocks held by sequences (1 = full).", key=names.POOL),
    _Observable("counter", names.KV_CACHE_SWAPPED_BLOCKS, "{block}", _swapped_blocks,
        "KV blocks copied between the GPU pool and the CPU swap pool (in: CPU to GPU).", key=names.DIRECTION),
    _Observable("counter", names.KV_CACHE_COPY_ON_WRITE_BLOCKS, "{block}",
        "block_manager.counters.copy_on_write_blocks",
        "KV blocks copied because a shared block was appended to (copy-on-write)."),
    _Observable("up_down_counter", names.KV_CACHE_TOKEN_SLOTS, "{token}", _token_slots,
        "Token slots of the blocks held by running and swapped sequences, by pool and state "
        "(used: holding a token; allocated: every slot of those blocks; a shared block counts once).",
        key=(names.POOL, names.STATE)),
    _Observable("gauge", names.KV_CACHE_FRAGMENTATION, "1", _fragmentation,
        "Share of the allocated token slots holding no token: 1 - used / allocated "
        "(internal fragmentation, the unfilled tails of last blocks; 0 when nothing is allocated).", key=names.POOL),
    _Observable("up_down_counter", names.KV_CACHE_SHARED_BLOCKS, "{block}", _shared_blocks,
        "KV blocks held by more than one sequence (forks, beams, prefix-cache hits), by pool.", key=names.POOL),
    _Observable("counter", names.PREFIX_CACHE_QUERIES, "{token}", "block_manager.counters.prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache at admission."),
    _Observable("counter", names.PREFIX_CACHE_HITS, "{token}", "block_manager.counters.prefix_cache_hits",
        "Of the prefix-cache queries, tokens found in cached blocks (not recomputed)."),
    _Observable("counter", names.PREFIX_CACHE_TIER_HITS, "{token}", _tier_hits,
        "Of the prefix-cache queries, tokens found in each tier: device (the KV cache) or host "
        "(tier 2, copied back instead of recomputed).", key=names.TIER),
    _Observable("counter", names.PREFIX_CACHE_TIER_BLOCKS, "{block}", _tier_blocks,
        "Prefix-cache blocks moved per tier: device evicted; host offloaded (device to host), "
        "restored (host to device), evicted (LRU, or taken by a swap-out).", key=(names.TIER, names.TIER_EVENT)),
    _Observable("counter", names.SPEC_DECODE_NUM_DRAFT_TOKENS, "{token}",
        "scheduler.counters.spec_decode_num_draft_tokens",
        "Draft tokens (speculative decoding) scheduled for verification."),
    _Observable("counter", names.SPEC_DECODE_NUM_ACCEPTED_TOKENS, "{token}", "spec_decode_num_accepted_tokens",
        "Of the draft tokens, those verification accepted (acceptance rate: accepted / draft)."),
    # -- scheduler
    _Observable("up_down_counter", names.SCHEDULER_REQUESTS, "{request}", _requests,
        "Unfinished requests (sequence groups) by queue: running, waiting, swapped.", key=names.STATE),
    _Observable("counter", names.SCHEDULER_PREEMPTIONS, "{preemption}", _preemptions,
        "Sequence groups preempted for lack of KV blocks, by mode (recompute, swap).", key=names.MODE),
    _Observable("counter", names.TOKENS, "{token}", _tokens,
        "Tokens computed: prompt (prefilled, after prefix-cache hits) and generation (sampled).", key=names.TOKEN_TYPE),
)  # fmt: skip

_SPEC_DECODE_POSITION_INSTRUMENTS = (  # only with speculative decoding
    _Observable("counter", names.SPEC_DECODE_NUM_DRAFT_TOKENS_PER_POSITION, "{token}",
        lambda e: _by_position(e.scheduler.counters.spec_decode_num_draft_tokens_per_position),
        "Draft tokens scheduled for verification, by position in their row (0: the first draft).",
        key=names.POSITION),
    _Observable("counter", names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POSITION, "{token}",
        lambda e: _by_position(e.spec_decode_num_accepted_tokens_per_position),
        "Of the draft tokens, those accepted, by position (acceptance at position j: accepted / draft "
        "at j; a draft is accepted only if every draft before it was).", key=names.POSITION),
)  # fmt: skip

_GRAMMAR_INSTRUMENTS = (  # only with structured outputs
    _Observable("counter", names.GRAMMAR_ERRORS, "{sequence}", lambda e: e.structured.errors.items(),
        "Sequences ended by a grammar error (finish_reason abort, stop_reason grammar_error), "
        "by stage: consume (the sampled token), mask (computing the next mask), mask_budget (masks "
        "costlier than the budget).", key=names.STAGE),
    _Observable("up_down_counter", names.GRAMMAR_CACHE_BYTES, "By", "grammars.num_cached_bytes",
        "Estimated bytes held by the compiled grammars in the cache."),
)  # fmt: skip

_LORA_INSTRUMENTS = (  # only with LoRA
    _Observable("up_down_counter", names.LORA_ADAPTERS, "{adapter}", _lora_adapters,
        "LoRA adapters by state: registered (requests may name them), resident (in a device "
        "slot), active (pinned by an admitted request).", key=names.STATE),
    _Observable("counter", names.LORA_SLOT_LOADS, "{adapter}", "lora_slots.counters.num_loads",
        "LoRA adapters put into a device slot (read from the CPU cache or from disk)."),
    _Observable("counter", names.LORA_SLOT_EVICTIONS, "{adapter}", "lora_slots.counters.num_evictions",
        "Of the slot loads, those that evicted an idle resident adapter (least recently used)."),
    _Observable("counter", names.LORA_REQUESTS, "{request}", lambda e: list(e.num_lora_requests.items()),
        "Requests added per LoRA adapter, by lora_name.", key=names.LORA_NAME),
)  # fmt: skip

# latency histograms (seconds), recorded once per finished request: (attribute, name, description)
_LATENCIES = (
    ("_ttft", names.REQUEST_TIME_TO_FIRST_TOKEN, "Arrival to the first generated token."),
    ("_tpot", names.REQUEST_TIME_PER_OUTPUT_TOKEN,
        "Mean time between output tokens of a request: (finish - first token) / (tokens - 1)."),
    ("_e2e", names.REQUEST_E2E_LATENCY, "Arrival to the last token (end-to-end latency)."),
    ("_queue", names.REQUEST_QUEUE_TIME, "Arrival to first scheduled (time spent waiting)."),
)  # fmt: skip


def finish_reason(output) -> str:
    """A finished request's reason: its first completion's. An output without completions
    is a request the engine ignored (it can never fit); the engine maps that to "length"."""
    if output.outputs and output.outputs[0].finish_reason is not None:
        return output.outputs[0].finish_reason
    return "length" if output.error is not None else "abort"


class EngineMetrics:
    def __init__(self, meter_provider: MeterProvider, engine: EngineLike, replica: str) -> None:
        self.engine = engine
        self.replica = replica
        self._attrs = {names.REPLICA: replica}
        self._reason_attrs: dict[str, dict[str, str]] = {}
        meter = meter_provider.get_meter(names.METER_NAME)

        instruments = list(_ENGINE_INSTRUMENTS)
        if getattr(getattr(engine.scheduler, "config", None), "speculative", None) is not None:
            instruments += _SPEC_DECODE_POSITION_INSTRUMENTS
        if getattr(engine, "structured", None) is not None:
            instruments += _GRAMMAR_INSTRUMENTS
        if getattr(engine, "lora_slots", None) is not None:
            instruments += _LORA_INSTRUMENTS
        for i in instruments:
            read = attrgetter(i.read) if isinstance(i.read, str) else i.read
            create = getattr(meter, f"create_observable_{i.kind}")
            create(i.name, callbacks=[self._observer(read, i.key)], unit=i.unit, description=i.description)

        # -- per finished request
        self._finished = meter.create_counter(
            names.REQUEST_FINISHED,
            unit="{request}",
            description="Finished requests by finish_reason (stop, length, abort).",
        )
        for attr, name, description in _LATENCIES:
            setattr(self, attr, meter.create_histogram(name, unit="s", description=description))

    # ------------------------------------------------------------------ per finished request

    def record_finished(self, output) -> None:
        """Count a finished RequestOutput and record its latencies (no-op while unfinished).
        Call once per request, with the output whose `finished` is True."""
        if not output.finished:
            return
        self._finished.add(1, self._reason_attributes(finish_reason(output)))
        m = output.metrics
        if m is None or m.first_token_time is None:  # ignored: never ran
            return
        self._ttft.record(m.first_token_time - m.arrival_time, self._attrs)
        if m.first_scheduled_time is not None:
            self._queue.record(m.first_scheduled_time - m.arrival_time, self._attrs)
        if m.finished_time is not None:
            self._e2e.record(m.finished_time - m.arrival_time, self._attrs)
            num_tokens = max((c.num_output_tokens for c in output.outputs), default=0)
            if num_tokens > 1:
                self._tpot.record((m.finished_time - m.first_token_time) / (num_tokens - 1), self._attrs)

    def record_aborted(self) -> None:
        """Count a request aborted by its caller (the engine returns no output for it)."""
        self._finished.add(1, self._reason_attributes("abort"))

    def _reason_attributes(self, reason: str) -> dict[str, str]:
        attrs = self._reason_attrs.get(reason)
        if attrs is None:
            attrs = self._reason_attrs[reason] = {**self._attrs, names.FINISH_REASON: reason}
        return attrs

    # ------------------------------------------------------------------ callbacks

    def _observer(self, read, key: str | tuple[str, ...] | None):
        """A callback for an instrument read by `read(engine)`: one value (no key), (label,
        value) pairs observed with attribute `key`, or (labels, value) pairs with a tuple of keys."""
        attrs = self._attrs

        def callback(options: CallbackOptions) -> Iterable[Observation]:
            value = read(self.engine)
            if key is None:
                return [Observation(value, attrs)]
            if isinstance(key, str):
                return [Observation(v, {**attrs, key: label}) for label, v in value]
            return [Observation(v, {**attrs, **dict(zip(key, labels))}) for labels, v in value]

        return callback
