"""Host time of the attention backend per layer, with the attention kernels stubbed out.

One step: 256 running decodes (context lengths 100-1000, block size 16), a model of
NUM_LAYERS layers with 32 query heads, 8 kv heads, head_dim 128. For each step a new
AttentionMetadata object is made (untimed), then timed:

    backend.begin_step(metadata)        when the backend has it (counted in the first layer)
    backend.forward(...) per layer      every layer with its own key/value cache

Backends and what is stubbed:

  triton   every Triton kernel (reshape_and_cache, prefill, decode, partitioned decode,
           reduce) is replaced by a no-op launcher, so the figure is the wrappers' Python:
           checks, launch planning, output/partition buffers (float16, CPU tensors; no
           GPU and no TRITON_INTERPRET needed)
  torch    the compiled CPU decode kernel and the cache write's copies are replaced by
           no-ops (float32; the write's input checks stay, where the code has them per
           layer); q/k/v are contiguous here, so that the figure holds no copy of them

Reported per backend: the median host time of the first layer of a step (what is done
once per step), of every other layer, and of a whole step divided by NUM_LAYERS.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import replace

import torch

from benchmarks.options import benchmark_parser
from benchmarks.records import report_rows
from rayserve_paged.ops.attention import AttentionMetadata

NUM_DECODES = 256
MIN_LEN, MAX_LEN = 100, 1000
BLOCK_SIZE = 16
NUM_LAYERS = 32
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
NUM_BLOCKS = 16  # block ids are never read (the kernels are stubbed): a small cache suffices
TARGET_LAYER_US = 15.0
TRITON_KERNELS = (
    "reshape_and_cache_kernel", "paged_prefill_kernel", "paged_decode_kernel",
    "paged_decode_partition_kernel", "paged_decode_reduce_kernel",
)  # fmt: skip


def build_metadata(seed: int) -> AttentionMetadata:
    """256 decodes; block tables point at random blocks of the small cache."""
    rng = random.Random(seed)
    lens = [rng.randint(MIN_LEN, MAX_LEN) for _ in range(NUM_DECODES)]
    max_blocks = -(-MAX_LEN // BLOCK_SIZE)
    tables = [[rng.randrange(NUM_BLOCKS) for _ in range(max_blocks)] for _ in lens]
    slots = [tables[i][(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for i, n in enumerate(lens)]
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_prefill_tokens=0,
        num_decode_tokens=NUM_DECODES,
        block_size=BLOCK_SIZE,
        prefill_query_start_loc=as_int([0]),
        prefill_context_lens=as_int([]),
        prefill_seq_lens=as_int([]),
        prefill_block_tables=torch.zeros((0, max_blocks), dtype=torch.int32),
        max_prefill_query_len=0,
        max_prefill_seq_len=0,
        decode_seq_lens=as_int(lens),
        decode_block_tables=as_int(tables),  # [256, max_blocks]
        max_decode_seq_len=max(lens),
        prefill_query_lens_host=[],
        prefill_seq_lens_host=[],
        decode_seq_lens_host=lens,
    )


def layer_inputs(dtype: torch.dtype, fused: bool) -> list[tuple]:
    """Per layer (query, key, value, key_cache, value_cache); fused: q/k/v are strided views
    of one QKV projection as in the models, else contiguous tensors."""
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    q_end, k_end = NUM_HEADS * HEAD_DIM, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn((NUM_DECODES, width)).to(dtype)  # [T, (H + 2 Hkv) * D]
    query = qkv[:, :q_end].view(NUM_DECODES, NUM_HEADS, HEAD_DIM)
    key = qkv[:, q_end:k_end].view(NUM_DECODES, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, k_end:].view(NUM_DECODES, NUM_KV_HEADS, HEAD_DIM)
    if not fused:
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [
        (query, key, value, torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype))
        for _ in range(NUM_LAYERS)
    ]


@contextmanager
def patched(*changes: tuple[object, str, object]):
    """Set module attributes (module, name, value) for the block; restore them after."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in changes]
    try:
        for module, name, value in changes:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def triton_stubs() -> list[tuple]:
    """Every Triton kernel a no-op launcher."""
    from triton.runtime.interpreter import InterpretedFunction

    from rayserve_paged.ops import triton_kernels

    class NoLaunch(InterpretedFunction):  # an InterpretedFunction: CPU tensors pass the launch check
        def __init__(self) -> None:
            pass

        def __getitem__(self, grid):
            return _no_op

    return [(triton_kernels, name, NoLaunch()) for name in TRITON_KERNELS]


def torch_stubs() -> list[tuple]:
    """The cache write's copies a no-op (where the write checks its inputs in every layer,
    the checks stay)."""
    from rayserve_paged.ops import cache_ops, paged_attention

    if hasattr(paged_attention, "write_slots"):  # the unchecked write, after the step's checks
        return [(paged_attention, "write_slots", _no_op)]

    def checks_only(key, value, key_cache, value_cache, slot_mapping):
        cache_ops._check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    return [(paged_attention, "reshape_and_cache", checks_only)]


def make_backend(name: str):
    """(backend, dtype, fused q/k/v, stubs); the torch backend's CPU decode kernel is a no-op."""
    if name == "triton":
        from rayserve_paged.ops.triton_backend import TritonBackend

        return TritonBackend(), torch.float16, True, triton_stubs()
    from rayserve_paged.ops.paged_attention import TorchReferenceBackend

    backend = TorchReferenceBackend()
    backend._kernel, backend._kernel_checked = _no_op, True
    return backend, torch.float32, False, torch_stubs()


def _no_op(*args, **kwargs) -> None:
    return None


def time_backend(backend, dtype: torch.dtype, fused: bool, steps: int, warmup: int, seed: int) -> dict:
    base = build_metadata(seed)
    layers = layer_inputs(dtype, fused)
    begin_step = getattr(backend, "begin_step", None)
    first, rest, per_step = [], [], []
    clock = time.perf_counter_ns
    for step in range(warmup + steps):
        metadata = replace(base)  # a new step: a new metadata object
        times = []
        start = clock()
        if begin_step is not None:
            begin_step(metadata)
        for query, key, value, key_cache, value_cache in layers:
            backend.forward(query, key, value, key_cache, value_cache, metadata, 0.1)
            end = clock()
            times.append(end - start)
            start = end
        if step >= warmup:
            first.append(times[0])
            rest.extend(times[1:])
            per_step.append(sum(times))
    us = lambda ns: round(ns / 1e3, 2)  # noqa: E731
    return {
        "first_layer_us": us(statistics.median(first)),
        "other_layers_us": us(statistics.median(rest)),
        "per_layer_of_step_us": us(statistics.median(per_step) / NUM_LAYERS),
        "step_us": us(statistics.median(per_step)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench attention-host", __doc__.splitlines()[0],
                              out_help="directory for attention_host.json", quick_help="5 timed steps after 1 (for tests)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per backend")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--backends", default="triton,torch", help="comma-separated: triton, torch")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 5, 1
    torch.set_num_threads(1)
    results = {}
    for name in args.backends.split(","):
        if name not in ("triton", "torch"):
            parser.error(f"unknown backend {name!r}")
        backend, dtype, fused, stubs = make_backend(name)
        with patched(*stubs):
            results[name] = time_backend(backend, dtype, fused, args.steps, args.warmup, args.seed)
    title = f"attention host time, {NUM_DECODES} decodes, {NUM_LAYERS} layers, kernels stubbed (median us)"
    report_rows(title, results, 7, args.out, "attention-host")
    print(f"  goal: other layers under {TARGET_LAYER_US} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
