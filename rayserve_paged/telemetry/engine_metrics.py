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

from collections.abc import Iterable
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

        # -- KV cache (observable: the block manager's state at collection)
        meter.create_observable_up_down_counter(
            names.KV_CACHE_BLOCKS,
            callbacks=[self._observe_blocks],
            unit="{block}",
            description="KV cache blocks by pool (device, cpu: the swap pool) and state (used: held by sequences; "
            "cached: free but holding a reusable prefix; free).",
        )
        meter.create_observable_gauge(
            names.KV_CACHE_USAGE,
            callbacks=[self._observe_usage],
            unit="1",
            description="Fraction of the pool's KV blocks held by sequences (1 = full).",
        )
        meter.create_observable_counter(
            names.KV_CACHE_SWAPPED_BLOCKS,
            callbacks=[self._counter(_swapped_blocks, names.DIRECTION)],
            unit="{block}",
            description="KV blocks copied between the GPU pool and the CPU swap pool (in: CPU to GPU).",
        )
        meter.create_observable_counter(
            names.KV_CACHE_COPY_ON_WRITE_BLOCKS,
            callbacks=[self._counter(lambda e: e.block_manager.counters.copy_on_write_blocks)],
            unit="{block}",
            description="KV blocks copied because a shared block was appended to (copy-on-write).",
        )
        meter.create_observable_up_down_counter(
            names.KV_CACHE_TOKEN_SLOTS,
            callbacks=[self._observe_token_slots],
            unit="{token}",
            description="Token slots of the blocks held by running and swapped sequences, by pool and state "
            "(used: holding a token; allocated: every slot of those blocks; a shared block counts once).",
        )
        meter.create_observable_gauge(
            names.KV_CACHE_FRAGMENTATION,
            callbacks=[self._observe_fragmentation],
            unit="1",
            description="Share of the allocated token slots holding no token: 1 - used / allocated "
            "(internal fragmentation, the unfilled tails of last blocks; 0 when nothing is allocated).",
        )
        meter.create_observable_up_down_counter(
            names.KV_CACHE_SHARED_BLOCKS,
            callbacks=[self._observe_shared_blocks],
            unit="{block}",
            description="KV blocks held by more than one sequence (forks, beams, prefix-cache hits), by pool.",
        )
        meter.create_observable_counter(
            names.PREFIX_CACHE_QUERIES,
            callbacks=[self._counter(lambda e: e.block_manager.counters.prefix_cache_queries)],
            unit="{token}",
            description="Prompt tokens looked up in the prefix cache at admission.",
        )
        meter.create_observable_counter(
            names.PREFIX_CACHE_HITS,
            callbacks=[self._counter(lambda e: e.block_manager.counters.prefix_cache_hits)],
            unit="{token}",
            description="Of the prefix-cache queries, tokens found in cached blocks (not recomputed).",
        )
        meter.create_observable_counter(
            names.PREFIX_CACHE_TIER_HITS,
            callbacks=[self._counter(_tier_hits, names.TIER)],
            unit="{token}",
            description="Of the prefix-cache queries, tokens found in each tier: device (the KV cache) or host "
            "(tier 2, copied back instead of recomputed).",
        )
        meter.create_observable_counter(
            names.PREFIX_CACHE_TIER_BLOCKS,
            callbacks=[self._tier_block_counter],
            unit="{block}",
            description="Prefix-cache blocks moved per tier: device evicted; host offloaded (device to host), "
            "restored (host to device), evicted (LRU, or taken by a swap-out).",
        )

        meter.create_observable_counter(
            names.SPEC_DECODE_NUM_DRAFT_TOKENS,
            callbacks=[self._counter(lambda e: e.scheduler.counters.spec_decode_num_draft_tokens)],
            unit="{token}",
            description="Draft tokens (speculative decoding) scheduled for verification.",
        )
        meter.create_observable_counter(
            names.SPEC_DECODE_NUM_ACCEPTED_TOKENS,
            callbacks=[self._counter(lambda e: e.spec_decode_num_accepted_tokens)],
            unit="{token}",
            description="Of the draft tokens, those verification accepted (acceptance rate: accepted / draft).",
        )

        # -- scheduler
        meter.create_observable_up_down_counter(
            names.SCHEDULER_REQUESTS,
            callbacks=[self._observe_requests],
            unit="{request}",
            description="Unfinished requests (sequence groups) by queue: running, waiting, swapped.",
        )
        meter.create_observable_counter(
            names.SCHEDULER_PREEMPTIONS,
            callbacks=[self._counter(_preemptions, names.MODE)],
            unit="{preemption}",
            description="Sequence groups preempted for lack of KV blocks, by mode (recompute, swap).",
        )
        meter.create_observable_counter(
            names.TOKENS,
            callbacks=[self._counter(_tokens, names.TOKEN_TYPE)],
            unit="{token}",
            description="Tokens computed: prompt (prefilled, after prefix-cache hits) and generation (sampled).",
        )

        if getattr(engine, "structured", None) is not None:
            meter.create_observable_counter(
                names.GRAMMAR_ERRORS,
                callbacks=[self._counter(lambda e: e.structured.errors.items(), names.STAGE)],
                unit="{sequence}",
                description="Sequences ended by a grammar error (finish_reason abort, stop_reason grammar_error), "
                "by stage: consume (the sampled token), mask (computing the next mask), mask_budget (masks "
                "costlier than the budget).",
            )
            meter.create_observable_up_down_counter(
                names.GRAMMAR_CACHE_BYTES,
                callbacks=[self._counter(lambda e: e.grammars.num_cached_bytes)],
                unit="By",
                description="Estimated bytes held by the compiled grammars in the cache.",
            )
        if getattr(engine, "lora_slots", None) is not None:
            self._add_lora_instruments(meter)

        # -- per finished request
        self._finished = meter.create_counter(
            names.REQUEST_FINISHED,
            unit="{request}",
            description="Finished requests by finish_reason (stop, length, abort).",
        )
        self._ttft = meter.create_histogram(
            names.REQUEST_TIME_TO_FIRST_TOKEN, unit="s", description="Arrival to the first generated token."
        )
        self._tpot = meter.create_histogram(
            names.REQUEST_TIME_PER_OUTPUT_TOKEN,
            unit="s",
            description="Mean time between output tokens of a request: (finish - first token) / (tokens - 1).",
        )
        self._e2e = meter.create_histogram(
            names.REQUEST_E2E_LATENCY, unit="s", description="Arrival to the last token (end-to-end latency)."
        )
        self._queue = meter.create_histogram(
            names.REQUEST_QUEUE_TIME, unit="s", description="Arrival to first scheduled (time spent waiting)."
        )

    def _add_lora_instruments(self, meter) -> None:
        meter.create_observable_up_down_counter(
            names.LORA_ADAPTERS,
            callbacks=[self._counter(_lora_adapters, names.STATE)],
            unit="{adapter}",
            description="LoRA adapters by state: registered (requests may name them), resident (in a device "
            "slot), active (pinned by an admitted request).",
        )
        meter.create_observable_counter(
            names.LORA_SLOT_LOADS,
            callbacks=[self._counter(lambda e: e.lora_slots.counters.num_loads)],
            unit="{adapter}",
            description="LoRA adapters put into a device slot (read from the CPU cache or from disk).",
        )
        meter.create_observable_counter(
            names.LORA_SLOT_EVICTIONS,
            callbacks=[self._counter(lambda e: e.lora_slots.counters.num_evictions)],
            unit="{adapter}",
            description="Of the slot loads, those that evicted an idle resident adapter (least recently used).",
        )
        meter.create_observable_counter(
            names.LORA_REQUESTS,
            callbacks=[self._counter(lambda e: list(e.num_lora_requests.items()), names.LORA_NAME)],
            unit="{request}",
            description="Requests added per LoRA adapter, by lora_name.",
        )

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

    def _counter(self, read, key: str | None = None):
        """A callback for a counter read by `read(engine)`: one value, or (label, value)
        pairs observed with attribute `key`."""
        attrs = self._attrs

        def callback(options: CallbackOptions) -> Iterable[Observation]:
            value = read(self.engine)
            if key is None:
                return [Observation(value, attrs)]
            return [Observation(v, {**attrs, key: label}) for label, v in value]

        return callback

    def _tier_block_counter(self, options: CallbackOptions) -> Iterable[Observation]:
        attrs = self._attrs
        return [
            Observation(v, {**attrs, names.TIER: tier, names.TIER_EVENT: event})
            for (tier, event), v in _tier_blocks(self.engine)
        ]

    def _observe_blocks(self, options: CallbackOptions) -> Iterable[Observation]:
        u = self.engine.block_manager.usage()
        rows = (
            (names.DEVICE_POOL, "used", u.gpu_used),
            (names.DEVICE_POOL, "cached", u.gpu_cached),
            (names.DEVICE_POOL, "free", u.gpu_free),
            (names.SWAP_POOL, "used", u.cpu_used),
            (names.SWAP_POOL, "free", u.cpu_free),
        )
        return [Observation(n, {**self._attrs, names.POOL: pool, names.STATE: state}) for pool, state, n in rows]

    def _observe_usage(self, options: CallbackOptions) -> Iterable[Observation]:
        u = self.engine.block_manager.usage()
        return [
            Observation(u.gpu_usage, {**self._attrs, names.POOL: names.DEVICE_POOL}),
            Observation(u.cpu_usage, {**self._attrs, names.POOL: names.SWAP_POOL}),
        ]

    def _slot_usage(self):
        """(pool, SlotUsage) of the sequences of running and swapped groups, read now."""
        s = self.engine.scheduler
        seqs = [seq for group in (*list(s.running), *list(s.swapped)) for seq in list(group.seqs)]
        gpu, cpu = self.engine.block_manager.slot_usage(seqs)
        return ((names.DEVICE_POOL, gpu), (names.SWAP_POOL, cpu))

    def _observe_token_slots(self, options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for pool, u in self._slot_usage():
            out.append(Observation(u.used_slots, {**self._attrs, names.POOL: pool, names.STATE: "used"}))
            out.append(Observation(u.allocated_slots, {**self._attrs, names.POOL: pool, names.STATE: "allocated"}))
        return out

    def _observe_fragmentation(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(u.fragmentation, {**self._attrs, names.POOL: pool}) for pool, u in self._slot_usage()]

    def _observe_shared_blocks(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(u.num_shared_blocks, {**self._attrs, names.POOL: pool}) for pool, u in self._slot_usage()]

    def _observe_requests(self, options: CallbackOptions) -> Iterable[Observation]:
        s = self.engine.scheduler
        # finished groups stay in `running` until the next schedule(); count only live ones
        num_running = sum(1 for g in list(s.running) if not g.is_finished())
        rows = (("running", num_running), ("waiting", len(s.waiting)), ("swapped", len(s.swapped)))
        return [Observation(n, {**self._attrs, names.STATE: state}) for state, n in rows]
