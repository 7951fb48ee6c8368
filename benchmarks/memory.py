"""KV-cache memory efficiency without a model: the paper's Figure 2 and Figure 13.

Every system serves the same request stream from the same KV budget:

    OPT-13B on an A100-40GB: 12 GB of KV cache / 800 KB per token (2 x 5120 x 40 layers
    x 2 bytes) = 12e9 / 800e3 = 15,000 token slots (decimal units, as the paper quotes them)

  paged         the real Scheduler + BlockManager, block size 16 (937 blocks = 14,992 slots)
  paged_block1  the same with block size 1 (15,000 blocks): the zero-waste limit
  orca_max      contiguous reservation of max_seq_len (2048) slots per request
  orca_pow2     ... of the next power of two of prompt + output
  orca_oracle   ... of exactly prompt + output (the length is known in advance)

No model runs. After each step every scheduled sequence gets one token; a request finishes
when it has its output length. The Orca baselines share one first-fit contiguous allocator
of 15,000 slots, FCFS admission with head-of-line blocking, and never preempt.

Accounting, taken once per step after scheduling (the state the model would run on):

    slots of the pool   = token state + reservation + internal + unallocated
      token state       tokens whose K/V are held (prompt + outputs so far)
      reservation       reserved slots the request will still fill (Orca only)
      internal          slots that will never be filled: reserved past prompt + output
                        (Orca), the unfilled tail of each last block (paged)
      unallocated       free slots (external fragmentation and idle space)
    utilization         token state / (token state + reservation + internal)

Two regimes: saturated (every request arrives at t=0, the waiting queue never empties;
figures averaged over steps between a warm-up and the last admission) and Poisson arrivals
timed by a step-time model (figures averaged over simulated time).
"""

from __future__ import annotations

import bisect
import math
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from benchmarks.options import benchmark_parser
from benchmarks.records import progress, write_report
from rayserve_paged.core.block_manager import BlockManager
from rayserve_paged.core.scheduler import PreemptionMode, Scheduler, SchedulerConfig
from rayserve_paged.core.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

KV_BUDGET_BYTES = 12e9
KV_BYTES_PER_TOKEN = 800e3  # OPT-13B: 2 (K, V) x 5120 hidden x 40 layers x 2 bytes (fp16)
NUM_SLOTS = round(KV_BUDGET_BYTES / KV_BYTES_PER_TOKEN)  # 15,000
MAX_SEQ_LEN = 2048
BLOCK_SIZE = 16
WATERMARK = 0.01  # the BlockManager default
# Far above anything memory allows (every running sequence and every batched token needs a
# slot, and there are at most 15,000), so memory is the only limit that binds.
MAX_NUM_SEQS = 16384
MAX_NUM_BATCHED_TOKENS = 16384

DEFAULT_SEED = 0
DEFAULT_NUM_REQUESTS = 3000
QUICK_NUM_REQUESTS = 300
# Alpaca requests are ~6x shorter, so a batch turns over ~6x faster: give it 4x as many
# requests so both saturated windows span many batch lifetimes at similar cost.
ALPACA_REQUEST_SCALE = 4
SATURATED_WARMUP = 0.15  # skip steps until this share of the requests has finished
POISSON_WARMUP = 0.2  # skip this share of the arrival period


# ---------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Dataset:
    """Log-normal prompt and output lengths with the paper's means (DESIGN.md section 8).

    mu = ln(mean) - sigma^2 / 2 makes the unclipped mean equal the paper's; lengths are
    rounded to integers >= 1, then the output is clipped so prompt + output <= 2048.
    """

    name: str
    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float
    poisson_rate: float  # requests per second (the paper's Figure 13 point)
    paper_mean_batched: dict[str, float]  # the paper's Figure 13 at that rate


DATASETS = {
    "sharegpt": Dataset(
        "sharegpt", 161.31, 1.0, 337.99, 0.8, 2.0,
        {"orca_max": 7.00, "orca_pow2": 9.81, "orca_oracle": 13.62, "paged": 30.42},
    ),
    "alpaca": Dataset(
        "alpaca", 19.31, 0.6, 58.45, 0.8, 30.0,
        {"orca_max": 7.00, "orca_pow2": 43.24, "orca_oracle": 72.75, "paged": 132.44},
    ),
}

# The paper's Figure 2: share of KV memory holding token state (OPT-13B, A100-40GB).
PAPER_TOKEN_STATE_SHARE = {"orca_max": 0.204, "orca_pow2": 0.268, "orca_oracle": 0.382, "paged": 0.963}


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    prompt_len: int
    output_len: int
    arrival_time: float = 0.0

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def _lognormal_len(rng: random.Random, mean: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def sample_requests(dataset: Dataset, num_requests: int, seed: int) -> list[Request]:
    """Lengths only; arrival times are added per regime (see `with_poisson_arrivals`)."""
    rng = random.Random(f"{dataset.name}-lengths-{seed}")
    requests = []
    for i in range(num_requests):
        prompt = min(_lognormal_len(rng, dataset.prompt_mean, dataset.prompt_sigma), MAX_SEQ_LEN - 1)
        output = min(_lognormal_len(rng, dataset.output_mean, dataset.output_sigma), MAX_SEQ_LEN - prompt)
        requests.append(Request(i, prompt, output))
    return requests


def with_poisson_arrivals(requests: list[Request], rate: float, seed: int, dataset: str) -> list[Request]:
    rng = random.Random(f"{dataset}-arrivals-{seed}")
    clock = 0.0
    timed = []
    for r in requests:
        clock += rng.expovariate(rate)
        timed.append(Request(r.index, r.prompt_len, r.output_len, clock))
    return timed


# ---------------------------------------------------------------------------- step model


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Seconds per step of OPT-13B (fp16) on one A100-40GB:

        t = base + per_token x tokens computed + per_context_token x tokens attended

      per_context_token  0.533 us: one token's 800 KB of K/V read at ~1.5 TB/s (physical)
      base, per_token    25 ms and 0.25 ms, fitted so that the paper's two vLLM points take
                         the step time Little's law implies for them (step = batched /
                         (rate x mean output len)):
                           ShareGPT 2 req/s: 30.42 batched, ~45 computed, ~15,000 attended
                             -> 30.42 / (2 x 338) = 45 ms   (model: 44.3 ms)
                           Alpaca 30 req/s: 132.44 batched, ~180 computed, ~6,600 attended
                             -> 132.44 / (30 x 58.45) = 76 ms   (model: 73.5 ms)
                         For scale: reading 26 GB of weights at ~1.5 TB/s is 17 ms, and
                         2 x 13e9 FLOPs per token at ~100-200 TFLOP/s is 0.13-0.26 ms.
    """

    base_s: float = 25e-3
    per_token_s: float = 0.25e-3
    per_context_token_s: float = 0.533e-6

    def __call__(self, num_computed_tokens: int, num_context_tokens: int) -> float:
        return self.base_s + self.per_token_s * num_computed_tokens + self.per_context_token_s * num_context_tokens


# ---------------------------------------------------------------------------- systems


@dataclass(slots=True)
class StepRecord:
    """One step's batch and the pool's accounting, after scheduling, before tokens land."""

    num_batched: int  # requests in the batch
    num_computed_tokens: int  # tokens whose K/V the step computes (prefill + decode)
    token_state: int  # slots holding token state (= tokens attended this step)
    reservation: int
    internal: int
    unallocated: int
    num_finished: int  # requests finished by this step


class PagedSystem:
    """The real Scheduler and BlockManager driven by a fake model (one token per step)."""

    def __init__(self, block_size: int, preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE) -> None:
        self.block_size = block_size
        self.block_manager = BlockManager(
            block_size=block_size,
            num_gpu_blocks=NUM_SLOTS // block_size,
            num_cpu_blocks=0,
            watermark=WATERMARK,
            # The synthetic prompts share no prefixes; a freed cached block counts as free
            # anyway, so caching would only add hashing work.
            enable_prefix_caching=False,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                max_model_len=MAX_SEQ_LEN,
                preemption_mode=preemption_mode,
            ),
            self.block_manager,
        )
        self.num_slots = self.block_manager.gpu.num_blocks * block_size
        self._output_len: dict[str, int] = {}
        self._params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.swapped)

    @property
    def is_idle(self) -> bool:
        return not self.scheduler.has_unfinished_groups()

    @property
    def num_preemptions(self) -> int:
        c = self.scheduler.counters
        return c.preemptions_recompute + c.preemptions_swap

    def add(self, request: Request) -> None:
        request_id = str(request.index)
        # Distinct token ids per request (no accidental sharing were caching switched on).
        base = request.index * 7919
        prompt = [(base + i) % 50_000 for i in range(request.prompt_len)]
        seq = Sequence(request.index, prompt)
        self._output_len[request_id] = request.output_len
        self.scheduler.add_group(
            SequenceGroup(request_id, [seq], self._params, request.arrival_time, request.index)
        )

    def step(self) -> StepRecord:
        out = self.scheduler.schedule()
        bm = self.block_manager
        num_allocated = (bm.gpu.num_blocks - bm.gpu.num_free_blocks) * self.block_size
        token_state = 0
        num_finished = 0
        for group, *_ in out.scheduled:
            for seq in group.seqs:
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                token_state += len(seq.token_ids)
                seq.append_token(0)
            if group.seqs[0].num_output_tokens >= self._output_len[group.request_id]:
                for seq in group.seqs:
                    seq.status = SequenceStatus.FINISHED_LENGTH
                self.scheduler.free_finished(group)
                del self._output_len[group.request_id]
                num_finished += 1
        return StepRecord(
            num_batched=len(out.scheduled),
            num_computed_tokens=out.num_batched_tokens,
            token_state=token_state,
            reservation=0,
            internal=num_allocated - token_state,
            unallocated=self.num_slots - num_allocated,
            num_finished=num_finished,
        )


class ContiguousAllocator:
    """First-fit allocator of contiguous slot ranges; frees coalesce with their neighbours."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._starts = [0]  # free ranges, sorted by start
        self._sizes = [num_slots]

    @property
    def num_free(self) -> int:
        return sum(self._sizes)

    def allocate(self, size: int) -> int | None:
        for i, free in enumerate(self._sizes):
            if free >= size:
                start = self._starts[i]
                if free == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                return start
        return None

    def free(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # merge with left
            i -= 1
            self._sizes[i] += size
        else:
            self._starts.insert(i, start)
            self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            del self._starts[i + 1]


def reserve_max(r: Request) -> int:
    return MAX_SEQ_LEN


def reserve_pow2(r: Request) -> int:
    return min(MAX_SEQ_LEN, 1 << (r.total_len - 1).bit_length())


def reserve_oracle(r: Request) -> int:
    return r.total_len


class OrcaSystem:
    """Contiguous reservation per request, FCFS admission, iteration-level batching,
    no preemption (a request keeps its reservation until it finishes)."""

    def __init__(self, reserve: Callable[[Request], int]) -> None:
        self.reserve = reserve
        self.allocator = ContiguousAllocator(NUM_SLOTS)
        self.num_slots = NUM_SLOTS
        self.num_preemptions = 0
        self.waiting: deque[Request] = deque()
        # [request, slot start, reserved size, tokens held]
        self.running: list[list] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def is_idle(self) -> bool:
        return not (self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def step(self) -> StepRecord:
        num_computed = len(self.running)  # one decode token each
        while self.waiting and len(self.running) < MAX_NUM_SEQS:
            request = self.waiting[0]
            size = self.reserve(request)
            start = self.allocator.allocate(size)
            if start is None:
                break  # head-of-line blocking: FCFS never skips
            self.waiting.popleft()
            self.running.append([request, start, size, request.prompt_len])
            num_computed += request.prompt_len
        token_state = reserved = total = 0
        for request, _, size, held in self.running:
            token_state += held
            total += request.total_len
            reserved += size
        still_running = []
        num_finished = 0
        for entry in self.running:
            request, start, size, held = entry
            if held + 1 - request.prompt_len >= request.output_len:
                self.allocator.free(start, size)
                num_finished += 1
            else:
                entry[3] = held + 1
                still_running.append(entry)
        num_batched = len(self.running)
        self.running = still_running
        return StepRecord(
            num_batched=num_batched,
            num_computed_tokens=num_computed,
            token_state=token_state,
            reservation=total - token_state,
            internal=reserved - total,
            unallocated=self.num_slots - reserved,
            num_finished=num_finished,
        )


SYSTEMS: dict[str, Callable[[], PagedSystem | OrcaSystem]] = {
    "orca_max": lambda: OrcaSystem(reserve_max),
    "orca_pow2": lambda: OrcaSystem(reserve_pow2),
    "orca_oracle": lambda: OrcaSystem(reserve_oracle),
    "paged": lambda: PagedSystem(BLOCK_SIZE),
    "paged_block1": lambda: PagedSystem(1),
}
POISSON_SYSTEMS = ("orca_max", "orca_pow2", "orca_oracle", "paged")


# ---------------------------------------------------------------------------- regimes


def _shares(records: list[StepRecord], weights: list[float], num_slots: int) -> dict[str, float]:
    """Weighted means: shares of the allocated slots, shares of the pool, batch size."""
    total_w = sum(weights)
    sums = dict.fromkeys(
        ("utilization", "reservation_share", "internal_share", "pool_token_state", "pool_reservation",
         "pool_internal", "pool_unallocated", "mean_batched"),
        0.0,
    )
    for rec, w in zip(records, weights):
        allocated = rec.token_state + rec.reservation + rec.internal
        if allocated:
            sums["utilization"] += w * rec.token_state / allocated
            sums["reservation_share"] += w * rec.reservation / allocated
            sums["internal_share"] += w * rec.internal / allocated
        else:
            sums["utilization"] += w
        sums["pool_token_state"] += w * rec.token_state / num_slots
        sums["pool_reservation"] += w * rec.reservation / num_slots
        sums["pool_internal"] += w * rec.internal / num_slots
        sums["pool_unallocated"] += w * rec.unallocated / num_slots
        sums["mean_batched"] += w * rec.num_batched
    return {k: v / total_w for k, v in sums.items()}


def run_saturated(make_system: Callable[[], PagedSystem | OrcaSystem], requests: list[Request]) -> dict:
    """All requests arrive at t=0; measure from warm-up until the last admission."""
    system = make_system()
    for r in requests:
        system.add(r)
    warmup = math.ceil(SATURATED_WARMUP * len(requests))
    num_finished = num_steps = 0
    window: list[StepRecord] = []
    while system.num_waiting:
        rec = system.step()
        num_steps += 1
        if num_finished >= warmup:
            window.append(rec)
        num_finished += rec.num_finished
    if not window:
        raise RuntimeError("no saturated window: raise --num-requests")
    shares = _shares(window, [1.0] * len(window), system.num_slots)
    return {
        "utilization": shares["utilization"],
        "mean_batched_saturated": shares["mean_batched"],
        "reservation_share": shares["reservation_share"],
        "internal_share": shares["internal_share"],
        "pool_token_state": shares["pool_token_state"],
        "pool_reservation": shares["pool_reservation"],
        "pool_internal": shares["pool_internal"],
        "pool_unallocated": shares["pool_unallocated"],
        "num_slots": system.num_slots,
        "saturated_window_steps": len(window),
        "saturated_steps": num_steps,
        "preemptions_saturated": system.num_preemptions,
    }


def run_poisson(
    make_system: Callable[[], PagedSystem | OrcaSystem], requests: list[Request], step_time: StepTimeModel
) -> dict:
    """Poisson arrivals; time-weighted means over [warm-up, last arrival]."""
    system = make_system()
    end = requests[-1].arrival_time
    start = POISSON_WARMUP * end
    clock = 0.0
    i = 0
    records: list[StepRecord] = []
    weights: list[float] = []
    while clock < end:
        while i < len(requests) and requests[i].arrival_time <= clock:
            system.add(requests[i])
            i += 1
        if system.is_idle:
            clock = requests[i].arrival_time  # nothing to do until the next arrival
            continue
        rec = system.step()
        dt = step_time(rec.num_computed_tokens, rec.token_state)
        # Only the part of the step inside the window counts; idle gaps count as empty.
        overlap = min(clock + dt, end) - max(clock, start)
        if overlap > 0:
            records.append(rec)
            weights.append(overlap)
        clock += dt
    busy = sum(weights)
    shares = _shares(records, weights, system.num_slots) if records else {"mean_batched": 0.0, "utilization": 0.0}
    # Idle time inside the window has an empty batch.
    mean_batched = shares["mean_batched"] * busy / (end - start)
    return {
        "mean_batched_poisson": mean_batched,
        "utilization_poisson": shares["utilization"],
        "num_waiting_at_end": system.num_waiting,
        "preemptions_poisson": system.num_preemptions,
    }


# ---------------------------------------------------------------------------- report


def _length_stats(requests: list[Request]) -> dict[str, float]:
    n = len(requests)
    return {
        "mean_prompt_len": sum(r.prompt_len for r in requests) / n,
        "mean_output_len": sum(r.output_len for r in requests) / n,
        "num_clipped": sum(1 for r in requests if r.total_len == MAX_SEQ_LEN),
    }


def num_requests_for(dataset: str, num_requests: int) -> int:
    return num_requests * (ALPACA_REQUEST_SCALE if dataset == "alpaca" else 1)


def run(num_requests: int, seed: int, quick: bool, log: Callable[[str], None] = print) -> dict:
    step_time = StepTimeModel()
    counts = {name: num_requests_for(name, num_requests) for name in DATASETS}
    # Poisson runs stop at the last arrival: 500 s of ShareGPT at 2 req/s, 100 s of Alpaca
    # at 30 req/s (each many request lifetimes long).
    num_poisson = {
        "sharegpt": min(counts["sharegpt"], 300 if quick else 1000),
        "alpaca": min(counts["alpaca"], 3000),
    }
    result: dict = {
        "config": {
            "kv_budget_bytes": KV_BUDGET_BYTES,
            "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
            "num_slots": NUM_SLOTS,
            "max_seq_len": MAX_SEQ_LEN,
            "block_size": BLOCK_SIZE,
            "watermark": WATERMARK,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "preemption_mode": PreemptionMode.RECOMPUTE.value,
            "enable_prefix_caching": False,
            "num_requests": counts,
            "num_poisson_requests": num_poisson,
            "saturated_warmup_finished_share": SATURATED_WARMUP,
            "poisson_warmup_share": POISSON_WARMUP,
            "step_time_model": asdict(step_time),
            "length_distribution": "lognormal, mu = ln(mean) - sigma^2/2, rounded, >= 1, "
            "output clipped so prompt + output <= max_seq_len",
            "datasets": {name: asdict(d) for name, d in DATASETS.items()},
        },
        "seed": seed,
        "quick": quick,
        "paper": {
            "token_state_share": PAPER_TOKEN_STATE_SHARE,
            "mean_batched_poisson": {name: d.paper_mean_batched for name, d in DATASETS.items()},
        },
    }
    for name, dataset in DATASETS.items():
        requests = sample_requests(dataset, counts[name], seed)
        timed = with_poisson_arrivals(requests[: num_poisson[name]], dataset.poisson_rate, seed, name)
        per_system: dict = {"workload": _length_stats(requests)}
        for system_name, make in SYSTEMS.items():
            t0 = time.perf_counter()
            figures = run_saturated(make, requests)
            if system_name in POISSON_SYSTEMS:
                figures.update(run_poisson(make, timed, step_time))
                figures["paper_mean_batched_poisson"] = dataset.paper_mean_batched[system_name]
            figures["seconds"] = time.perf_counter() - t0
            per_system[system_name] = figures
            log(f"  {name:9s} {system_name:13s} done in {figures['seconds']:.1f} s")
        result[name] = per_system
    result["targets"] = check_targets(result)
    return result


def check_targets(result: dict) -> list[dict]:
    sg = result["sharegpt"]
    paged = sg["paged"]["mean_batched_saturated"]
    batched = {name: figures["mean_batched_saturated"] for name, figures in sg.items() if name != "workload"}
    targets = [
        ("sharegpt paged utilization >= 96%", sg["paged"]["utilization"], 0.96),
        ("sharegpt saturated batched: paged / orca_oracle >= 1.5", paged / batched["orca_oracle"], 1.5),
        ("sharegpt saturated batched: paged / orca_max >= 4", paged / batched["orca_max"], 4.0),
        ("sharegpt saturated batched: paged / paged_block1 >= 0.98", paged / batched["paged_block1"], 0.98),
    ]
    return [{"target": t, "value": v, "threshold": th, "passed": v >= th} for t, v, th in targets]


def format_report(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"KV budget {cfg['kv_budget_bytes'] / 1e9:.0f} GB / {cfg['kv_bytes_per_token'] / 1e3:.0f} KB per token "
        f"= {cfg['num_slots']} token slots; max_seq_len {cfg['max_seq_len']}, block size {cfg['block_size']}, "
        f"seed {result['seed']}; requests (saturated / Poisson): "
        + ", ".join(f"{n} {cfg['num_requests'][n]} / {cfg['num_poisson_requests'][n]}" for n in DATASETS),
        "",
    ]
    header = (
        f"{'dataset':9s} {'system':13s} {'util':>6s} | {'token':>6s} {'reserv':>6s} {'intern':>6s} {'free':>6s} "
        f"| {'batched':>8s} | {'poisson':>8s} {'paper':>7s}"
    )
    lines += [
        "utilization = token state / allocated slots; token/reserv/intern/free = shares of the whole pool",
        "batched = mean batched requests, saturated; poisson = mean batched requests at the paper's rate",
        "",
        header,
        "-" * len(header),
    ]
    for name, dataset in DATASETS.items():
        w = result[name]["workload"]
        for system_name in SYSTEMS:
            f = result[name][system_name]
            poisson = f"{f['mean_batched_poisson']:8.2f}" if "mean_batched_poisson" in f else f"{'-':>8s}"
            paper = f"{f['paper_mean_batched_poisson']:7.2f}" if "paper_mean_batched_poisson" in f else f"{'-':>7s}"
            lines.append(
                f"{name:9s} {system_name:13s} {f['utilization']:6.1%} | {f['pool_token_state']:6.1%} "
                f"{f['pool_reservation']:6.1%} {f['pool_internal']:6.1%} {f['pool_unallocated']:6.1%} "
                f"| {f['mean_batched_saturated']:8.2f} | {poisson} {paper}"
            )
        lines.append(
            f"{'':9s} ({name}: rate {dataset.poisson_rate:g} req/s; mean prompt {w['mean_prompt_len']:.1f}, "
            f"mean output {w['mean_output_len']:.1f} after clipping; {w['num_clipped']} clipped)"
        )
    m = StepTimeModel()
    lines += [
        "",
        f"step time = {m.base_s * 1e3:g} ms + {m.per_token_s * 1e3:g} ms x tokens computed "
        f"+ {m.per_context_token_s * 1e6:g} us x tokens attended "
        "(OPT-13B / A100: KV read bandwidth; base and per-token fitted to the paper's vLLM points)",
        "paper token-state share of KV memory: " + ", ".join(
            f"{k} {v:.1%}" for k, v in PAPER_TOKEN_STATE_SHARE.items()
        ),
        "",
        "targets:",
    ]
    for t in result["targets"]:
        lines.append(f"  [{'PASS' if t['passed'] else 'FAIL'}] {t['target']}: {t['value']:.3f}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(SYSTEMS)
    fig, axes = plt.subplots(len(DATASETS), 2, figsize=(12, 4.6 * len(DATASETS)))
    for row, dataset in enumerate(DATASETS):
        figures = result[dataset]
        ax = axes[row][0]
        bottom = [0.0] * len(names)
        for key, label in [
            ("pool_token_state", "token state"),
            ("pool_reservation", "reservation"),
            ("pool_internal", "internal"),
            ("pool_unallocated", "unallocated"),
        ]:
            values = [figures[n][key] * 100 for n in names]
            ax.bar(names, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        for x, n in enumerate(names):
            ax.text(x, 101, f"util {figures[n]['utilization']:.0%}", ha="center", fontsize=8)
        ax.set_ylim(0, 110)
        ax.set_ylabel("% of KV slots (time average)")
        ax.set_title(f"{dataset}: KV memory use, saturated")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)
        ax.tick_params(axis="x", labelrotation=20)

        ax = axes[row][1]
        xs = range(len(names))
        width = 0.4
        sat = [figures[n]["mean_batched_saturated"] for n in names]
        poi = [figures[n].get("mean_batched_poisson", 0.0) for n in names]
        ax.bar([x - width / 2 for x in xs], sat, width, label="saturated")
        ax.bar([x + width / 2 for x in xs], poi, width, label=f"Poisson {DATASETS[dataset].poisson_rate:g} req/s")
        paper = [DATASETS[dataset].paper_mean_batched.get(n) for n in names]
        ax.scatter(
            [x + width / 2 for x, p in zip(xs, paper) if p is not None],
            [p for p in paper if p is not None],
            marker="_", s=300, color="black", label="paper (Fig. 13)", zorder=3,
        )
        ax.set_xticks(list(xs), names, rotation=20)
        ax.set_ylabel("mean batched requests")
        ax.set_title(f"{dataset}: batched requests")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench memory", __doc__.splitlines()[0], out_required=True,
                              out_help="directory for memory.json and memory.png", seed=DEFAULT_SEED,
                              quick_help=f"seconds, for tests ({QUICK_NUM_REQUESTS} requests)")
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"ShareGPT requests; Alpaca gets {ALPACA_REQUEST_SCALE}x as many (default {DEFAULT_NUM_REQUESTS})",
    )
    args = parser.parse_args(argv)
    num_requests = args.num_requests or (QUICK_NUM_REQUESTS if args.quick else DEFAULT_NUM_REQUESTS)
    if num_requests < 20:
        parser.error("--num-requests must be >= 20")
    result = run(num_requests, args.seed, args.quick, log=progress)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "memory.png")
    plot(result, png)
    write_report(args.out, "memory.json", result, format_report, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
