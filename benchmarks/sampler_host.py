"""Host time of sampling one step: building the sampler's batch plus the sampler call.

One step of NUM_ROWS running decodes, one sequence per request, parameters cached per
request (the worker keeps them), logits [NUM_ROWS, vocab] float32 on CPU. Timed per step
(time.perf_counter_ns, after warm-up), Python's garbage collector enabled:

    build   worker/input_batch.InputBatch.sampling_batch(step message, rows of the worker's
            persistent batch, where each request's row template is cached)
    sample  Sampler(logits, batch)
    total   both

The vocabulary is small by default (256) so that the figure is the host's Python and
torch dispatch, not the CPU doing a GPU's arithmetic; pass --vocab for a real one.

Cases:

  greedy_256   every row greedy, no logprobs: the sampler's fast path
  sampled_256  temperature 0.8, top-p 0.9, each request seeded: the general path

--baseline-sampler FILE times, interleaved step by step with the current code, a
sampler module from FILE with the call shape it had before SamplingBatch:
Sampler()(logits, groups, group_params), e.g. the file as of commit a4299eb:

    git show a4299eb:rayserve_paged/models/sampler.py > /tmp/sampler_before.py
    rayserve-paged bench sampler-host --baseline-sampler /tmp/sampler_before.py
"""

from __future__ import annotations

import random
import sys
import time

import torch

from benchmarks.records import chosen_cases, host_time_parser, load_module, median_us, print_rows, write_record
from rayserve_paged.core.outputs import NewRequest, StepMessage
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.models.sampler import Sampler
from rayserve_paged.worker.input_batch import InputBatch

NUM_ROWS = 256
EOS = (2,)
CASES = {
    "greedy_256": dict(temperature=0.0, max_tokens=None),
    "sampled_256": dict(temperature=0.8, top_p=0.9, max_tokens=None),
}


class _OldSeq:
    """A scheduled sequence as the sampler before SamplingBatch read it."""

    __slots__ = ("seq_id", "num_output_tokens", "sample_index", "history")

    def __init__(self, seq_id: int, num_output_tokens: int) -> None:
        self.seq_id = seq_id
        self.num_output_tokens = num_output_tokens
        self.sample_index = 0
        self.history = None


class _OldGroup:
    __slots__ = ("seqs", "is_first_step", "num_prompt_tokens")

    def __init__(self, seq: _OldSeq) -> None:
        self.seqs = [seq]
        self.is_first_step = False
        self.num_prompt_tokens = PROMPT_LEN


PROMPT_LEN = 100


def build_step(case: str, seed: int) -> tuple[InputBatch, StepMessage, list[_OldGroup], list[SamplingParams]]:
    """A worker's batch holding NUM_ROWS requests, one decode step of all of them, and the
    same step in the old sampler's shape."""
    rng = random.Random(seed)
    params = []
    for _ in range(NUM_ROWS):
        extra = {"seed": rng.randrange(1 << 30)} if case == "sampled_256" else {}
        params.append(SamplingParams(**CASES[case], **extra))
    batch = InputBatch(EOS)
    batch.apply(StepMessage(
        new_requests=[NewRequest(f"r{i}", i, p, PROMPT_LEN) for i, p in enumerate(params)],
        block_table_updates=[(i, 0, [i]) for i in range(NUM_ROWS)],
    ))
    starts = [PROMPT_LEN + rng.randint(0, 199) for _ in range(NUM_ROWS)]
    msg = StepMessage(
        seq_ids=list(range(NUM_ROWS)), start_positions=starts, num_query_tokens=[1] * NUM_ROWS,
        token_ids=[rng.randrange(1000) for _ in range(NUM_ROWS)],
    )
    old_groups = [_OldGroup(_OldSeq(i, start + 1 - PROMPT_LEN)) for i, start in enumerate(starts)]
    return batch, msg, old_groups, params


def load_baseline(path: str):
    return load_module(path, "sampler_baseline").Sampler(len(EOS), EOS)


def time_case(case: str, vocab: int, steps: int, warmup: int, seed: int, baseline) -> dict:
    state, msg, groups, params = build_step(case, seed)  # row templates cached per request
    logits = torch.randn(NUM_ROWS, vocab, generator=torch.Generator().manual_seed(seed))  # [rows, vocab]
    sampler = Sampler(len(EOS), EOS)
    build_ns, total_ns, before_ns = [], [], []
    for step in range(warmup + steps):
        start = time.perf_counter_ns()
        batch = state.sampling_batch(msg, state.rows(msg))
        built = time.perf_counter_ns()
        out = sampler(logits, batch)
        done = time.perf_counter_ns()
        if baseline is not None:
            b_start = time.perf_counter_ns()
            before = baseline(logits, groups, params)
            b_done = time.perf_counter_ns()
            if case == "greedy_256" and [s.token_ids for s in before.samples] != [s.token_ids for s in out.samples]:
                raise AssertionError("the baseline sampler chose other greedy tokens")
        if step >= warmup:
            build_ns.append(built - start)
            total_ns.append(done - start)
            if baseline is not None:
                before_ns.append(b_done - b_start)
    row = {"build_us": median_us(build_ns), "sample_us": median_us([t - b for t, b in zip(total_ns, build_ns)]),
           "total_us": median_us(total_ns)}
    if baseline is not None:
        row["baseline_total_us"] = median_us(before_ns)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = host_time_parser(
        "rayserve-paged bench sampler-host", __doc__.splitlines()[0], CASES, out_name="sampler_host.json",
        baseline_flag="--baseline-sampler", baseline_help="a sampler.py with the old call shape, timed alongside",
    )
    parser.add_argument("--vocab", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    baseline = load_baseline(args.baseline_sampler) if args.baseline_sampler else None
    results = {
        case: time_case(case, args.vocab, args.steps, args.warmup, args.seed, baseline)
        for case in chosen_cases(parser, CASES, args.cases)
    }
    print_rows(f"sampler host time, {NUM_ROWS} rows, vocab {args.vocab} (median us per step)", results, 12)
    if args.out:
        write_record(args.out, "sampler-host", results, vocab=args.vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
