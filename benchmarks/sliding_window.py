"""Sliding-window models: KV blocks held per sequence with and without freeing the blocks
before the window, and the CPU decode attention time with the window against without.

blocks   the block manager alone (pure Python, exact): NUM_SEQS sequences with a
         PROMPT-token prompt decode until 4 x WINDOW tokens; blocks held per sequence at the
         end and at most during the run, with `sliding_window=WINDOW` and without it
time     one attention layer's decode on the CPU (torch backend: the compiled decode kernel,
         and the torch path), NUM_SEQS sequences at context 4 x WINDOW, float32, Llama-8B
         heads (32 query, 8 kv, head_dim 128): median per step with the window and without

    python -m benchmarks.sliding_window [--window 1024] [--block-size 16] [--steps 30] [--out DIR]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from benchmarks.options import benchmark_parser
from benchmarks.records import write_record
from rayserve_paged.core import BlockManager, SequenceStatus
from rayserve_paged.core.sequence import Sequence, SequenceGroup, SamplingParams
from rayserve_paged.ops import TorchReferenceBackend, cpu_decode
from rayserve_paged.ops.attention import AttentionMetadata

NUM_SEQS = 8
PROMPT = 100
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def blocks_held(window: int | None, block_size: int, target_len: int) -> dict:
    """Run NUM_SEQS sequences from PROMPT to target_len tokens through the block manager."""
    num_blocks = NUM_SEQS * (-(-target_len // block_size) + 1)
    bm = BlockManager(block_size, num_blocks, 0, sliding_window=window)
    seqs = []
    for i in range(NUM_SEQS):
        seq = Sequence(i, list(range(i * 100_000, i * 100_000 + PROMPT)))
        group = SequenceGroup(f"r{i}", [seq], SamplingParams(), arrival_time=0.0, arrival_index=i)
        bm.allocate(group)
        seq.status = SequenceStatus.RUNNING
        bm.mark_computed(seq, PROMPT)
        seq.num_computed_tokens = PROMPT
        seqs.append(seq)
    peak = 0
    while len(seqs[0]) < target_len:
        for seq in seqs:
            seq.append_token(7)
            bm.append_slots(seq, [])
            seq.num_computed_tokens = len(seq)
            peak = max(peak, bm.num_held_blocks(seq))
    return {"blocks_per_seq_at_end": bm.num_held_blocks(seqs[0]), "peak_blocks_per_seq": peak,
            "pool_blocks_used": bm.usage().gpu_used}  # fmt: skip


def decode_metadata(context_len: int, block_size: int) -> tuple[AttentionMetadata, int]:
    blocks_per_seq = -(-context_len // block_size)
    tables = torch.arange(NUM_SEQS * blocks_per_seq, dtype=torch.int32).view(NUM_SEQS, blocks_per_seq)
    slots = tables[:, -1].long() * block_size + (context_len - 1) % block_size
    lens = [context_len] * NUM_SEQS
    empty = torch.zeros(0, dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=slots, num_prefill_tokens=0, num_decode_tokens=NUM_SEQS, block_size=block_size,
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32), prefill_context_lens=empty, prefill_seq_lens=empty,
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32), max_prefill_query_len=0, max_prefill_seq_len=0,
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32), decode_block_tables=tables,
        max_decode_seq_len=context_len, prefill_query_lens_host=[], prefill_seq_lens_host=[],
        decode_seq_lens_host=lens,
    )  # fmt: skip
    return metadata, NUM_SEQS * blocks_per_seq


def decode_ms(window: int | None, use_kernel: bool, context_len: int, block_size: int, steps: int, seed: int = 0) -> float:
    metadata, num_blocks = decode_metadata(context_len, block_size)
    generator = torch.Generator().manual_seed(seed)
    cache_shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, generator=generator)
    value_cache = torch.randn(cache_shape, generator=generator)
    query = torch.randn(NUM_SEQS, NUM_HEADS, HEAD_DIM, generator=generator)
    key = torch.randn(NUM_SEQS, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    value = torch.randn(NUM_SEQS, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    backend = TorchReferenceBackend(use_cpu_kernel=use_kernel)
    times = []
    for step in range(steps + 3):
        start = time.perf_counter()
        backend.forward(query, key, value, key_cache, value_cache, metadata, HEAD_DIM**-0.5, window)
        if step >= 3:  # the first steps build the plan and the kernel
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("python -m benchmarks.sliding_window", __doc__.splitlines()[0],
                              out_help="directory for sliding_window.json", quick_help="window 64, 3 timed steps (for tests)")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per configuration")
    args = parser.parse_args(argv)
    if args.quick:
        args.window, args.steps = 64, 3
    window, block_size = args.window, args.block_size
    context_len = 4 * window
    results = {"blocks": {}, "decode_ms": {}}
    for name, w in (("with freeing", window), ("without freeing", None)):
        results["blocks"][name] = blocks_held(w, block_size, context_len)
    print(f"KV blocks per sequence at {context_len} tokens (4 x window {window}, block size {block_size}):")
    for name, r in results["blocks"].items():
        print(f"  {name:16s} at end {r['blocks_per_seq_at_end']:5d}  peak {r['peak_blocks_per_seq']:5d}  "
              f"pool used by {NUM_SEQS} seqs {r['pool_blocks_used']:6d}")  # fmt: skip
    paths = {"cpu kernel": True, "torch path": False} if cpu_decode.load() is not None else {"torch path": False}
    print(f"one layer's decode, {NUM_SEQS} seqs at context {context_len}, {NUM_HEADS}/{NUM_KV_HEADS} heads x "
          f"{HEAD_DIM}, float32, {torch.get_num_threads()} threads: median ms per step")  # fmt: skip
    for path, use_kernel in paths.items():
        for name, w in ((f"window {window}", window), ("no window", None)):
            ms = decode_ms(w, use_kernel, context_len, block_size, args.steps, args.seed)
            results["decode_ms"][f"{path}, {name}"] = ms
            print(f"  {path:10s} {name:12s} {ms:8.2f}")
    if args.out:
        print(write_record(args.out, "sliding-window", results, window=window, block_size=block_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
