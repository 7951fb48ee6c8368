"""The triton kernels against the torch reference backend and cache_ops, on random inputs.

Runs on CPU under the Triton interpreter (TRITON_INTERPRET=1, set below before triton is
imported) unless RAYSERVE_PAGED_TRITON_TEST_DEVICE=cuda (the default when CUDA is present),
in which case the same tests run compiled on the GPU (benchmarks/gpu_check.py does this).

Outputs start poisoned with NaN, and caches hold NaN wherever nothing was written, so an
element a kernel forgets to write, or a slot it reads without reason, fails the comparison.
Shapes stay small: the interpreter costs ~0.1 s per (sequence, kv head) program.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import torch

DEVICE = os.environ.get("RAYSERVE_PAGED_TRITON_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated, i.e. at import below

import pytest  # noqa: E402

from rayserve_paged.ops import PAD_SLOT, TorchReferenceBackend, get_attention_backend  # noqa: E402
from rayserve_paged.ops import cache_ops  # noqa: E402
from rayserve_paged.ops import triton_backend, triton_kernels  # noqa: E402
from rayserve_paged.ops.triton_backend import (  # noqa: E402
    TritonBackend,
    choose_decode_partition,
    choose_decode_variant,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
)

from .builders import counted, make_attention_inputs, make_metadata  # noqa: E402

if DEVICE == "cpu" and not triton_backend.is_interpreted():
    importlib.reload(triton_kernels)  # something imported the kernels before the variable was set
assert (DEVICE == "cpu") == triton_backend.is_interpreted(), "kernels must be interpreted exactly on CPU"

# Same-dtype comparison with the reference: both round to the output dtype once.
TOLERANCES = {torch.float32: 5e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = list(TOLERANCES)
BLOCK_SIZES = [8, 16, 32]
HEADS = [(4, 4), (4, 2), (8, 2)]  # (num_heads, num_kv_heads): GQA ratios 1, 2, 4
HEAD_DIMS = [64, 80, 96, 128, 256]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def randn(generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=DEVICE)


def nan_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full_like(tensor, float("nan"))


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact, NaN == NaN (the poisoned slots)."""
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


# ---------------------------------------------------------------------------- forward


def run_both(case, generator, *, block_size, heads, head_dim, dtype, with_host_lists=True):
    """Reference and triton forward on the same inputs (separate cache copies)."""
    batch = make_metadata(
        **case, block_size=block_size, generator=generator, device=DEVICE, with_host_lists=with_host_lists
    )
    num_heads, num_kv_heads = heads
    inputs = make_attention_inputs(
        batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=generator, dtype=dtype
    )
    scale = head_dim**-0.5
    reference_caches = (inputs.key_cache.clone(), inputs.value_cache.clone())
    expected = TorchReferenceBackend().forward(
        inputs.query, inputs.key, inputs.value, *reference_caches, batch.metadata, scale
    )
    out = nan_like(inputs.query)  # [num_tokens, num_heads, head_dim]
    returned = TritonBackend().forward(
        inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, batch.metadata, scale, out=out
    )
    assert returned is out
    return batch, inputs, out, expected, reference_caches


def assert_forward_matches(batch, inputs, out, expected, reference_caches, dtype):
    num_real = batch.num_real_tokens
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(out[:num_real], expected[:num_real], atol=tolerance, rtol=tolerance)
    assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:]))  # padding rows
    assert_bitwise_equal(inputs.key_cache, reference_caches[0])
    assert_bitwise_equal(inputs.value_cache, reference_caches[1])


CASES = {
    "prefill_fresh": dict(prefills=[(0, 5), (0, 17), (0, 1)]),
    "prefill_context": dict(prefills=[(16, 3), (7, 20), (33, 1)]),  # prefix hits / recompute
    "decode": dict(decodes=[0, 5, 31, 40]),
    "mixed": dict(prefills=[(0, 9), (12, 4)], decodes=[3, 17, 64]),
    "mixed_padded": dict(prefills=[(5, 6)], decodes=[8, 0], num_pad_tokens=3),
}


def _forward_params():
    """Every case in every dtype; block size, GQA ratio and head size rotate so that each
    dtype meets all three block sizes, all three ratios and all five head sizes."""
    params = []
    for i, dtype in enumerate(DTYPES):
        for j, (name, case) in enumerate(CASES.items()):
            block_size = BLOCK_SIZES[(i + j) % 3]
            heads = HEADS[(2 * i + j) % 3]
            head_dim = HEAD_DIMS[(i + j) % 5]
            case_id = f"{name}-{dtype_name(dtype)}-bs{block_size}-h{heads[0]}kv{heads[1]}-d{head_dim}"
            marks = [pytest.mark.quick] if name == "mixed_padded" else []
            params.append(pytest.param(case, dtype, block_size, heads, head_dim, id=case_id, marks=marks))
    return params


@pytest.mark.parametrize("case, dtype, block_size, heads, head_dim", _forward_params())
def test_forward_matches_reference(case, dtype, block_size, heads, head_dim, generator):
    results = run_both(case, generator, block_size=block_size, heads=heads, head_dim=head_dim, dtype=dtype)
    assert_forward_matches(*results, dtype)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_every_block_size_with_every_gqa_ratio(block_size, heads, generator):
    results = run_both(CASES["mixed"], generator, block_size=block_size, heads=heads, head_dim=64, dtype=torch.float32)
    assert_forward_matches(*results, torch.float32)


@pytest.mark.parametrize(
    "heads, head_dim",
    [((6, 2), 64), ((16, 2), 64), ((4, 4), 16), ((2, 1), 48)],
    ids=["gqa3", "gqa8", "d16_tiny_models", "d48"],
)
def test_odd_groups_and_head_sizes(heads, head_dim, generator):
    """A group size that is not a power of two (rows of a prefill tile do not divide evenly),
    a large group, and the head sizes of the tiny test models."""
    results = run_both(CASES["mixed_padded"], generator, block_size=16, heads=heads, head_dim=head_dim,
                       dtype=torch.float16)
    assert_forward_matches(*results, torch.float16)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_prefill_spanning_several_query_tiles(heads, generator):
    """40 new tokens after a 37-token context: with GQA 4 a program takes 16 tokens, so the
    causal boundary crosses three query tiles and non-aligned context blocks."""
    case = dict(prefills=[(37, 40), (0, 33)])
    results = run_both(case, generator, block_size=8, heads=heads, head_dim=64, dtype=torch.float32)
    assert_forward_matches(*results, torch.float32)


def test_forward_without_host_lists(generator):
    """The kernels read lengths from device tensors only; the host lists are optional."""
    case = CASES["mixed_padded"]
    results = run_both(
        case, generator, block_size=16, heads=(4, 2), head_dim=64, dtype=torch.float16, with_host_lists=False
    )
    assert_forward_matches(*results, torch.float16)


def test_forward_with_strided_views_of_packed_qkv(generator):
    """What the model passes: query, key and value are views of one [T, (H + 2 Hkv) * D] tensor."""
    batch = make_metadata(prefills=[(5, 7)], decodes=[9, 20], num_pad_tokens=2, block_size=16, generator=generator,
                          device=DEVICE)
    num_heads, num_kv_heads, head_dim = 4, 2, 80
    inputs = make_attention_inputs(batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                   generator=generator, dtype=torch.float32)
    num_tokens = batch.num_tokens
    qkv = torch.cat([inputs.query.reshape(num_tokens, -1), inputs.key.reshape(num_tokens, -1),
                     inputs.value.reshape(num_tokens, -1)], dim=1)  # [T, (H + 2 Hkv) * D]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    assert not query.is_contiguous() and not key.is_contiguous()
    reference_caches = (inputs.key_cache.clone(), inputs.value_cache.clone())
    expected = TorchReferenceBackend().forward(
        inputs.query, inputs.key, inputs.value, *reference_caches, batch.metadata, 0.1
    )
    out = TritonBackend().forward(query, key, value, inputs.key_cache, inputs.value_cache, batch.metadata, 0.1)
    assert out.is_contiguous()
    assert_forward_matches(batch, inputs, out, expected, reference_caches, torch.float32)


def test_forward_with_only_padding_tokens(generator):
    batch = make_metadata(num_pad_tokens=3, block_size=16, generator=generator, device=DEVICE)
    inputs = make_attention_inputs(batch, num_heads=4, num_kv_heads=2, head_dim=64, generator=generator)
    cache_before = inputs.key_cache.clone()
    out = TritonBackend().forward(
        inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, batch.metadata, 0.1,
        out=nan_like(inputs.query),
    )
    assert torch.equal(out, torch.zeros_like(out))
    assert_bitwise_equal(inputs.key_cache, cache_before)


# ---------------------------------------------------------------------------- decode variants


def decode_problem(generator, decodes, *, block_size, heads, head_dim, dtype, table_dtype=torch.int32):
    """Caches holding every decode sequence's whole context (new token included, written by
    the reference), the reference output, and the decode arguments."""
    batch = make_metadata(decodes=decodes, block_size=block_size, generator=generator, device=DEVICE)
    num_heads, num_kv_heads = heads
    inputs = make_attention_inputs(
        batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=generator, dtype=dtype
    )
    metadata = batch.metadata
    scale = head_dim**-0.5
    expected = TorchReferenceBackend().forward(
        inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, metadata, scale
    )
    args = (
        inputs.query, inputs.key_cache, inputs.value_cache, metadata.decode_block_tables.to(table_dtype),
        metadata.decode_seq_lens.to(table_dtype), metadata.max_decode_seq_len, scale,
    )
    return args, expected


def _variant_params():
    params = []
    for variant in ("single", "partitioned"):
        for i, dtype in enumerate(DTYPES):
            block_size, heads = BLOCK_SIZES[i], HEADS[(i + 1) % 3]
            head_dim = (64, 80, 128)[i]
            case_id = f"{variant}-{dtype_name(dtype)}-bs{block_size}-h{heads[0]}kv{heads[1]}-d{head_dim}"
            marks = [pytest.mark.quick] if dtype == torch.float16 else []
            params.append(pytest.param(variant, dtype, block_size, heads, head_dim, id=case_id, marks=marks))
    return params


@pytest.mark.parametrize("variant, dtype, block_size, heads, head_dim", _variant_params())
def test_decode_variant_matches_reference(variant, dtype, block_size, heads, head_dim, generator):
    """Contexts on, just past and well past partition boundaries (partition_size 64 here)."""
    decodes = [0, 63, 64, 130, 200]  # seq_lens 1, 64, 65, 131, 201: 1 to 4 partitions
    args, expected = decode_problem(generator, decodes, block_size=block_size, heads=heads, head_dim=head_dim,
                                    dtype=dtype)
    out = nan_like(args[0])
    paged_decode_attention(*args, out=out, variant=variant, partition_size=64)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("partition_size", [16, 48, 128])
def test_partitioned_decode_with_partitions_unaligned_to_tiles(partition_size, generator):
    """A partition need not be a multiple of the key tile or the block size."""
    args, expected = decode_problem(generator, [7, 100, 47], block_size=16, heads=(4, 2), head_dim=64,
                                    dtype=torch.float32, table_dtype=torch.int64)
    out = paged_decode_attention(*args, variant="partitioned", partition_size=partition_size)
    torch.testing.assert_close(out, expected, atol=5e-5, rtol=5e-5)


class LaunchRecorder:
    """Stands in for a jitted kernel: records `kernel[grid]` launches, then runs the kernel."""

    def __init__(self, kernel, launches: list, name: str) -> None:
        self.kernel, self.launches, self.name = kernel, launches, name

    def __getitem__(self, grid):
        self.launches.append((self.name, tuple(grid)))
        return self.kernel[grid]


@pytest.fixture
def decode_launches(monkeypatch) -> list:
    launches: list = []
    for name in ("paged_decode_kernel", "paged_decode_partition_kernel", "paged_decode_reduce_kernel"):
        monkeypatch.setattr(triton_kernels, name, LaunchRecorder(getattr(triton_kernels, name), launches, name))
    monkeypatch.setattr(triton_backend, "is_interpreted", lambda: DEVICE == "cpu")
    return launches


@pytest.mark.parametrize(
    "decodes, expected_kernels, grid",
    [
        ([600, 3], ["paged_decode_partition_kernel", "paged_decode_reduce_kernel"], (2, 2, 3)),  # 601 > 256
        ([255, 3], ["paged_decode_kernel"], (2, 2)),  # seq_len 256 fits the smallest partition
    ],
    ids=["long_context_partitioned", "short_context_single"],
)
def test_backend_picks_decode_variant_by_the_rule(decodes, expected_kernels, grid, decode_launches, generator):
    """Two sequences x 2 kv heads is far below 4 programs per SM: the length decides, and
    the smallest partition size (256 tokens) is the one that comes closest to filling the SMs."""
    batch = make_metadata(decodes=decodes, block_size=32, generator=generator, device=DEVICE)
    inputs = make_attention_inputs(batch, num_heads=4, num_kv_heads=2, head_dim=64, generator=generator)
    reference_caches = (inputs.key_cache.clone(), inputs.value_cache.clone())
    expected = TorchReferenceBackend().forward(
        inputs.query, inputs.key, inputs.value, *reference_caches, batch.metadata, 0.125
    )
    out = TritonBackend().forward(
        inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, batch.metadata, 0.125
    )
    assert [name for name, _ in decode_launches] == expected_kernels
    assert decode_launches[0][1] == grid  # (num_seqs, num_kv_heads[, ceil(601 / 256)])
    torch.testing.assert_close(out, expected, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize(
    "num_seqs, num_kv_heads, max_seq_len, expected",
    [
        (1, 8, 8192, 256),  # one long sequence: 8 programs; 32 partitions of 256 -> 256 programs
        (1, 8, 65536, 512),  # 1024: 64 x 8 = 512 < 528 programs; 512: 128 x 8 = 1024
        (4, 8, 65536, 1024),  # 64 partitions of 1024 x 32 = 2048 >= 528
        (16, 8, 2048, 256),  # 128 programs, x 8 partitions = 1024 >= 528
        (16, 8, 4096, 512),  # 128 x 8 partitions of 512 = 1024 >= 528
        (65, 8, 4096, 1024),  # 520 < 528; 4 partitions of 1024 suffice
        (66, 8, 4096, 0),  # 528: enough programs, short enough for one pass
        (256, 8, 8192, 0),
        (256, 8, 8193, 1024),  # past 8192 tokens: always partitioned, skewed batches included
        (512, 8, 32768, 1024),
        (16, 8, 256, 0),  # one partition: nothing to split
        (16, 8, 257, 256),
        (1, 1, 1, 0),
    ],
)
def test_decode_partition_rule(num_seqs, num_kv_heads, max_seq_len, expected):
    assert choose_decode_partition(num_seqs, num_kv_heads, max_seq_len, num_sms=132) == expected
    variant = "partitioned" if expected else "single"
    assert choose_decode_variant(num_seqs, num_kv_heads, max_seq_len, num_sms=132) == variant


def test_decode_partition_rule_scales_with_sm_count():
    assert choose_decode_partition(64, 8, 4096, num_sms=132) == 1024
    assert choose_decode_partition(64, 8, 4096, num_sms=64) == 0
    assert choose_decode_partition(64, 8, 16384, num_sms=64) == 1024  # long: partitioned anyway


def test_decode_workspace_covers_the_largest_partition_buffers(monkeypatch):
    """The KV sizing reserves decode_workspace_bytes; every launch the rule can make for up
    to max_num_seqs sequences and max_seq_len tokens must fit in it."""
    most = triton_backend.decode_workspace_bytes(8, 32, 8, 128, 3000, num_sms=132)
    launched = []
    for num_seqs in range(1, 9):
        for length in range(1, 3001):
            size = choose_decode_partition(num_seqs, 8, length, 132)
            if size:
                launched.append(4 * num_seqs * 32 * -(-length // size) * (128 + 2))  # [S, H, P, 128] + 2 x [S, H, P]
    assert most == max(launched)
    assert triton_backend.decode_workspace_bytes(8, 32, 8, 128, 256, num_sms=132) == 0  # never partitioned


class ArgumentRecorder:
    """Stands in for a jitted kernel: records each launch's arguments by name, then runs it."""

    def __init__(self, kernel, launches: list, name: str) -> None:
        self.kernel, self.launches, self.name = kernel, launches, name

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.arg_names, args)) | kwargs
            self.launches.append((self.name, named))
            return self.kernel[grid](*args, **kwargs)

        return launch


KERNEL_NAMES = ("paged_decode_kernel", "paged_decode_partition_kernel", "paged_decode_reduce_kernel",
                "paged_prefill_kernel", "reshape_and_cache_kernel")
# what triton specialises a launch on, besides constants: arguments it never specialises
NOT_SPECIALIZED = {
    "paged_decode_kernel": {"stride_table_seq", "window"},
    "paged_decode_partition_kernel": {"stride_table_seq", "max_partitions", "window"},
    "paged_decode_reduce_kernel": {"max_partitions", "window"},
    "paged_prefill_kernel": {"stride_table_seq", "window"},
    "reshape_and_cache_kernel": set(),
}


def specialization_key(named: dict, not_specialized: set) -> tuple:
    """Triton's launch-time key, as its launcher builds it: constants by value; integers by
    (== 1, divisible by 16) unless listed in do_not_specialize; floats by type; tensors by
    dtype and 16-byte alignment of their data pointer."""
    key = []
    for name, value in sorted(named.items()):
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or not isinstance(value, int):
            key.append((name, value if name.isupper() or name == "num_warps" else type(value)))
        elif name.isupper() or name == "num_warps":
            key.append((name, value))
        elif name not in not_specialized:
            key.append((name, value == 1, value % 16 == 0))
    return tuple(key)


def test_do_not_specialize_lists_the_step_varying_arguments():
    from rayserve_paged.ops.triton_aot import not_specialized_arguments

    for name, expected in NOT_SPECIALIZED.items():
        assert not_specialized_arguments(getattr(triton_kernels, name)) == expected, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_name)
def test_steps_of_different_shapes_launch_the_same_variants(dtype, monkeypatch, generator):
    """Two serving steps with different block-table widths, context lengths, partition counts
    and token counts: every kernel must be launched with the same specialization key (no
    recompile while serving), with the constants triton_aot compiles ahead of time."""
    from rayserve_paged.ops import triton_aot

    launches: list = []
    for name in KERNEL_NAMES:
        monkeypatch.setattr(triton_kernels, name, ArgumentRecorder(getattr(triton_kernels, name), launches, name))
    monkeypatch.setattr(triton_backend, "is_interpreted", lambda: DEVICE == "cpu")
    keys: dict[str, set] = {}
    steps = [dict(prefills=[(0, 5)], decodes=[300, 2]), dict(prefills=[(7, 33), (16, 2)], decodes=[17, 700, 9, 1])]
    for step in steps:
        batch = make_metadata(**step, block_size=16, generator=generator, device=DEVICE)
        inputs = make_attention_inputs(batch, num_heads=8, num_kv_heads=2, head_dim=80, generator=generator,
                                       dtype=dtype)
        TritonBackend().forward(inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache,
                                batch.metadata, 0.1)
    partitions = {named["max_partitions"] for name, named in launches if name == "paged_decode_reduce_kernel"}
    widths = {named["stride_table_seq"] for name, named in launches if name == "paged_prefill_kernel"}
    assert len(partitions) == 2 and len(widths) == 2  # the steps really differ in what used to specialise
    for name, named in launches:
        keys.setdefault(name, set()).add(specialization_key(named, NOT_SPECIALIZED[name]))
        aot_kernel = {"paged_decode_kernel": "decode", "paged_decode_partition_kernel": "decode_partition",
                      "paged_decode_reduce_kernel": "decode_reduce", "paged_prefill_kernel": "prefill",
                      "reshape_and_cache_kernel": "reshape_and_cache"}[name]
        config = triton_aot.KernelConfig(aot_kernel, dtype_name(dtype), 80, group_size=4, block_size=16,
                                         num_kv_heads=2, partition_size=named.get("PARTITION_SIZE", 0))
        _, _, constants, _, num_warps = triton_aot.launch_spec(config)
        launched = {k: v for k, v in named.items() if k.isupper()}
        assert launched == constants and named["num_warps"] == num_warps, name
    assert set(keys) == set(KERNEL_NAMES) - {"paged_decode_kernel"}
    assert all(len(variants) == 1 for variants in keys.values()), keys


def test_warm_up_launches_every_variant_and_leaves_the_cache_alone(monkeypatch, generator):
    launches: list = []
    for name in KERNEL_NAMES:
        monkeypatch.setattr(triton_kernels, name, ArgumentRecorder(getattr(triton_kernels, name), launches, name))
    monkeypatch.setattr(triton_backend, "is_interpreted", lambda: DEVICE == "cpu")
    key_cache, value_cache = randn(generator, 2, 8, 1, 16), randn(generator, 2, 8, 1, 16)  # the smallest shapes
    before = (key_cache.clone(), value_cache.clone())
    launched = triton_backend.warm_up(key_cache, value_cache, num_heads=2)
    assert launched == ["reshape_and_cache", "prefill", "decode single"] + [
        f"decode partitioned {size}" for size in triton_backend.PARTITION_SIZES
    ]
    names = [name for name, _ in launches]
    assert set(names) == set(KERNEL_NAMES)
    sizes = {named["PARTITION_SIZE"] for name, named in launches if name == "paged_decode_reduce_kernel"}
    assert sizes == set(triton_backend.PARTITION_SIZES)
    assert_bitwise_equal(key_cache, before[0])
    assert_bitwise_equal(value_cache, before[1])


@pytest.mark.parametrize("class_base, expected_partitions", [(1024, [3, 3, 3]), (256, [0, 0, 3])])
def test_the_static_decode_path_launches_only_warmed_up_variants(monkeypatch, generator, class_base,
                                                                 expected_partitions):
    """Decode steps of two buckets on the static-shape path (worker/static_decode.py) launch
    every kernel with a specialization key warm_up launched too, so capturing or replaying
    them compiles nothing after start-up; each (bucket, length class) is planned for the
    class's length (the same partition count whatever the step's lengths within the class),
    which is what lets a graph replay it. One class (600 = max_model_len): 3 partitions at
    every step; classes 256 and 600: the single-pass kernel while the longest sequence fits
    256 tokens (the rule's pick at that length), 3 partitions once it does not."""
    from rayserve_paged.worker.static_decode import DecodeRows, StaticDecode

    num_heads, num_kv_heads, head_dim, block_size, max_model_len = 2, 1, 16, 16, 600
    width, stride = num_heads * head_dim, (num_heads + 2 * num_kv_heads) * head_dim
    launches: list = []
    for name in KERNEL_NAMES:
        monkeypatch.setattr(triton_kernels, name, ArgumentRecorder(getattr(triton_kernels, name), launches, name))
    monkeypatch.setattr(triton_backend, "is_interpreted", lambda: DEVICE == "cpu")
    caches = [(randn(generator, 8, block_size, num_kv_heads, head_dim).to(DEVICE),
               randn(generator, 8, block_size, num_kv_heads, head_dim).to(DEVICE))]
    triton_backend.warm_up(*caches[0], num_heads, query_token_stride=stride)
    warmed = {(name, specialization_key(named, NOT_SPECIALIZED[name])) for name, named in launches}
    launches.clear()
    backend = TritonBackend()

    class OneLayer(torch.nn.Module):
        """Queries, keys and values as slices of one QKV projection, as in the models."""

        def forward(self, input_ids, positions, kv_caches, metadata):
            qkv = randn(generator, input_ids.shape[0], stride).to(DEVICE)  # [T, (H + 2 Hkv) D]
            query = qkv[:, :width].view(-1, num_heads, head_dim)
            key = qkv[:, width : width + num_kv_heads * head_dim].view(-1, num_kv_heads, head_dim)
            value = qkv[:, width + num_kv_heads * head_dim :].view(-1, num_kv_heads, head_dim)
            return backend.forward(query, key, value, *kv_caches[0], metadata, 0.25).reshape(-1, width)

    static = StaticDecode(OneLayer(), block_size, 4, max_model_len, DEVICE, backend, length_class_base=class_base)
    long_table = [1, 2, 3, 4, 5, 6, 7] * 2 + [1, 2, 3, 4, 5]  # 19 blocks: 300 tokens
    steps = [
        DecodeRows([5], [4], [5], [[3]], [3 * block_size + 4], [0]),  # bucket 1
        DecodeRows([5, 6, 7], [39, 6, 0], [40, 7, 1], [[1, 2, 3], [4], [5]],
                   [3 * block_size + 7, 4 * block_size + 6, 5 * block_size], [0, 1, 2]),  # bucket 4
        DecodeRows([5, 6], [299, 6], [300, 7], [long_table, [4]], [5 * block_size + 11, 4 * block_size + 6], [0, 1]),
    ]
    partitions = []
    with torch.inference_mode():
        for rows in steps:
            hidden = static.forward(rows, caches)
            assert hidden.shape == (len(rows), width) and torch.isfinite(hidden).all()
            partitions.append(backend._plan.decode.max_partitions)  # 0: the single-pass kernel
    assert static.runs == {"graph": 0, "eager": 3}
    assert partitions == expected_partitions
    launched = {(name, specialization_key(named, NOT_SPECIALIZED[name])) for name, named in launches}
    single = {"paged_decode_kernel"} if 0 in partitions else set()
    assert {name for name, _ in launched} == {"reshape_and_cache_kernel", "paged_decode_partition_kernel",
                                              "paged_decode_reduce_kernel"} | single
    assert launched <= warmed, launched - warmed
    grids = {named["max_partitions"] for name, named in launches if name == "paged_decode_reduce_kernel"}
    assert grids == set(expected_partitions) - {0}


# ---------------------------------------------------------------------------- prefill (direct)


def test_prefill_kernel_directly_with_int64_metadata(generator):
    batch = make_metadata(prefills=[(9, 12), (0, 4)], block_size=8, generator=generator, device=DEVICE)
    inputs = make_attention_inputs(batch, num_heads=8, num_kv_heads=2, head_dim=96, generator=generator,
                                   dtype=torch.bfloat16)
    metadata = batch.metadata
    expected = TorchReferenceBackend().forward(
        inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, metadata, 0.1
    )  # also writes the new tokens into the caches, as the prefill kernel expects
    out = nan_like(inputs.query)
    paged_prefill_attention(
        inputs.query, inputs.key_cache, inputs.value_cache, metadata.prefill_block_tables.long(),
        metadata.prefill_query_start_loc.long(), metadata.prefill_context_lens.long(),
        metadata.max_prefill_query_len, 0.1, out=out,
    )
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------- reshape_and_cache


@pytest.mark.quick
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_reshape_and_cache_matches_cache_ops_exactly(block_size, dtype, generator):
    num_blocks, num_kv_heads, head_dim = 6, 3, 80
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    num_slots = num_blocks * block_size
    slots = torch.randperm(num_slots, generator=generator)[:9].tolist()
    slots[2] = slots[7] = PAD_SLOT
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    key = randn(generator, 9, num_kv_heads, head_dim, dtype=dtype)  # [num_tokens, kv_heads, d]
    value = randn(generator, 9, num_kv_heads, head_dim, dtype=dtype)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    cache_ops.reshape_and_cache(key, value, expected_key, expected_value, slot_mapping)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert_bitwise_equal(key_cache, expected_key)
    assert_bitwise_equal(value_cache, expected_value)
    assert int(torch.isnan(key_cache).sum()) == (num_slots - 7) * num_kv_heads * head_dim


def test_reshape_and_cache_reads_strided_key_and_value(generator):
    kv = randn(generator, 5, 2, 2, 64)  # [num_tokens, k|v, kv_heads, d]
    key, value = kv[:, 0], kv[:, 1]  # token stride 256, not 128
    key_cache = torch.full((4, 8, 2, 64), float("nan"), device=DEVICE)
    value_cache = torch.full((4, 8, 2, 64), float("nan"), device=DEVICE)
    slot_mapping = torch.tensor([3, 30, PAD_SLOT, 8, 17], device=DEVICE)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    cache_ops.reshape_and_cache(key, value, expected_key, expected_value, slot_mapping)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert_bitwise_equal(key_cache, expected_key)
    assert_bitwise_equal(value_cache, expected_value)


# ---------------------------------------------------------------------------- copy_blocks / swap_blocks


def random_layers(generator, *, num_layers=3, num_blocks=10, block_size=8, dtype=torch.float32):
    shape = (num_blocks, block_size, 2, 80)  # [num_blocks, block_size, kv_heads, head_dim]
    return [(randn(generator, *shape, dtype=dtype), randn(generator, *shape, dtype=dtype)) for _ in range(num_layers)]


def test_block_moves_are_the_batched_cache_ops_copies():
    """copy_blocks and swap are torch copies (cache_ops), not kernels: one Triton copy kernel
    read its pointers through an int -> pointer cast that hid their alignment (2-byte loads)."""
    assert triton_backend.swap_blocks is cache_ops.swap_blocks
    assert triton_backend.swap_kv_blocks is cache_ops.swap_kv_blocks
    assert triton_backend.copy_blocks is cache_ops.copy_blocks
    assert not hasattr(triton_kernels, "copy_blocks_kernel")
    layers = random_layers(torch.Generator().manual_seed(0), num_layers=2)
    expected = [(key.clone(), value.clone()) for key, value in layers]
    cache_ops.copy_blocks(expected, [(1, 5), (9, 0)])
    TritonBackend.copy_blocks(layers, [(1, 5), (9, 0)])
    for (key, value), (expected_key, expected_value) in zip(layers, expected):
        assert_bitwise_equal(key, expected_key)
        assert_bitwise_equal(value, expected_value)


# ---------------------------------------------------------------------------- checks and dispatch


def _decode_args(generator, **override):
    args = dict(
        query=randn(generator, 2, 4, 64),  # [num_seqs, num_heads, head_dim]
        key_cache=randn(generator, 4, 16, 2, 64), value_cache=randn(generator, 4, 16, 2, 64),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([20, 32], dtype=torch.int32, device=DEVICE), max_seq_len=32, scale=0.1,
    )
    return args | override


BAD_DECODES = {
    "query dims": (lambda g: dict(query=randn(g, 2, 256)), "query must be"),
    "float64": (
        lambda g: dict(query=randn(g, 2, 4, 64).double(), key_cache=randn(g, 4, 16, 2, 64).double(),
                       value_cache=randn(g, 4, 16, 2, 64).double()),
        "query dtype torch.float64 is not one of float16, bfloat16, float32",
    ),
    "cache dtype": (lambda g: dict(query=randn(g, 2, 4, 64).half()), "key_cache dtype torch.float32 != query dtype"),
    "block size 64": (
        lambda g: dict(key_cache=randn(g, 2, 64, 2, 64), value_cache=randn(g, 2, 64, 2, 64)),
        r"block_size=64 is not one of \(8, 16, 32\)",
    ),
    "head_dim 8": (
        lambda g: dict(query=randn(g, 2, 4, 8), key_cache=randn(g, 4, 16, 2, 8), value_cache=randn(g, 4, 16, 2, 8)),
        r"head_dim=8 is outside the supported \[16, 256\]",
    ),
    "head_dim mismatch": (lambda g: dict(query=randn(g, 2, 4, 32)), "query head_dim=32 != cache head_dim=64"),
    "query stride": (lambda g: dict(query=randn(g, 2, 64, 4).transpose(1, 2)), "contiguous last dim"),
    "gqa": (lambda g: dict(query=randn(g, 2, 3, 64)), "num_heads=3 is not a multiple of num_kv_heads=2"),
    "table rows": (
        lambda g: dict(block_tables=torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)), "3 rows for 2 query tokens"
    ),
    "table dtype": (
        lambda g: dict(block_tables=torch.zeros(2, 2, dtype=torch.float32, device=DEVICE)), "must be int32 or int64"
    ),
    "seq_lens shape": (
        lambda g: dict(seq_lens=torch.zeros(3, dtype=torch.int32, device=DEVICE)), r"seq_lens must have shape \(2,\)"
    ),
    "max_seq_len": (lambda g: dict(max_seq_len=33), "max_seq_len=33 does not fit block_tables of 2 blocks x 16"),
    "out shape": (lambda g: dict(out=torch.empty(2, 4, 32, device=DEVICE)), "out shape"),
    "variant": (lambda g: dict(variant="v2"), "variant must be auto, single or partitioned"),
    "non-contiguous cache": (
        lambda g: dict(key_cache=randn(g, 16, 4, 2, 64).transpose(0, 1)), "must be contiguous"
    ),
}


@pytest.mark.parametrize("override, message", BAD_DECODES.values(), ids=BAD_DECODES.keys())
def test_decode_rejects_bad_inputs(override, message, generator):
    args = _decode_args(generator, **override(generator))
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


def test_prefill_rejects_bad_metadata(generator):
    query = randn(generator, 5, 4, 64)
    caches = (randn(generator, 4, 16, 2, 64), randn(generator, 4, 16, 2, 64))
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    start_loc = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    context_lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \(3,\)"):
        paged_prefill_attention(query, *caches, tables, start_loc[:2], context_lens, 3, 0.1)
    with pytest.raises(ValueError, match=r"context_lens must be int32 or int64"):
        paged_prefill_attention(query, *caches, tables, start_loc, context_lens.float(), 3, 0.1)
    with pytest.raises(ValueError, match=r"max_query_len=6 must be in \[0, num_prefill_tokens=5\]"):
        paged_prefill_attention(query, *caches, tables, start_loc, context_lens, 6, 0.1)


def test_forward_reuses_the_reference_input_checks(generator):
    batch = make_metadata(decodes=[3], block_size=16, generator=generator, device=DEVICE)
    inputs = make_attention_inputs(batch, num_heads=4, num_kv_heads=2, head_dim=64, generator=generator)
    with pytest.raises(ValueError, match="metadata.block_size=8 != key_cache block_size=16"):
        batch.metadata.block_size = 8
        TritonBackend().forward(inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache,
                                batch.metadata, 0.1)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors")
def test_cpu_tensors_are_refused_without_the_interpreter(monkeypatch, generator):
    monkeypatch.setattr(triton_backend, "is_interpreted", lambda: False)
    with pytest.raises(ValueError, match="need CUDA tensors .or CPU tensors with TRITON_INTERPRET=1"):
        paged_decode_attention(**_decode_args(generator))
    batch = make_metadata(decodes=[3], block_size=16, generator=generator)
    inputs = make_attention_inputs(batch, num_heads=4, num_kv_heads=2, head_dim=64, generator=generator)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        TritonBackend().forward(inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache,
                                batch.metadata, 0.1)


def test_dispatch_gives_the_triton_backend():
    backend = get_attention_backend("triton", DEVICE)
    assert type(backend) is TritonBackend and backend.name == "triton"
    expected_auto = TritonBackend if DEVICE == "cuda" else TorchReferenceBackend
    assert type(get_attention_backend("auto", DEVICE)) is expected_auto


# ---------------------------------------------------------------------------- benchmarks/gpu_check.py


def once(torch_module, fn, *, repeats):
    """A stand-in for gpu_check's CUDA timer: runs `fn` once and reports a fixed time."""
    fn()
    return {"ms": 1.0, "eager_ms": 1.0, "timing": "stand-in"}


def test_gpu_check_parses_arguments_and_counts_bytes_and_flops(tmp_path):
    from benchmarks import gpu_check, gpu_kernels

    args = gpu_check.parse_args([str(tmp_path), "--quick"])
    assert args.out_dir == tmp_path and args.quick and not args.skip_tests
    # K and V of 512 tokens x 8 kv heads x 128 lanes x 2 bytes, query + output, table row + length
    assert gpu_kernels.decode_bytes(1, 512, 2) == 2 * 512 * 8 * 128 * 2 + 2 * 32 * 128 * 2 + 32 * 4 + 4
    assert gpu_kernels.prefill_flops(1, 0, 4) == 4 * 32 * 128 * (1 + 2 + 3 + 4)
    assert gpu_kernels.prefill_flops(2, 3, 2) == 2 * 4 * 32 * 128 * (4 + 5)


def test_gpu_check_measurement_code_runs_on_this_device():
    """The GPU-only measurement paths, on tiny shapes with a stand-in timer: the paged
    results must agree with the dense SDPA the script compares against."""
    from benchmarks import gpu_check, gpu_kernels

    decode = gpu_kernels.decode_point(torch, torch.float32, 2, 40, repeats=1, device=DEVICE, timer=once)
    assert decode["variant"] == "single" and decode["bytes"] == gpu_kernels.decode_bytes(2, 40, 4)
    assert decode["max_abs_diff_vs_dense"] < 1e-4
    assert decode["fits_l2"] and decode["working_set_bytes"] == decode["bytes"]  # a tiny point: flagged
    for context in (0, 16):
        prefill = gpu_kernels.prefill_point(torch, torch.float32, 2, context, 8, repeats=1, device=DEVICE, timer=once)
        assert "dense_error" not in prefill and prefill["max_abs_diff_vs_dense"] < 1e-4
        assert prefill["fits_l2"] and prefill["working_set_bytes"] == 2 * 2 * (context + 8) * 8 * 128 * 4 + 2 * 16 * 32 * 128 * 4
    report = {
        "environment": {"torch": "x", "triton": "y", "device": "GPU"}, "quick": False, "skipped": {}, "errors": {},
        "tests": {"summary": "1 passed", "interpreter": False},
        "copy_bandwidth": {"gbps": 4000.0, "bytes": 2**31},
        "decode": [decode | {"fraction_of_copy_bandwidth": 0.5}, {"batch": 1, "skipped": "time budget"}],
        "prefill": [prefill],
    }
    table = gpu_check.format_table(report)
    assert "decode" in table and "prefill" in table and "4000 GB/s" in table


# ---------------------------------------------------------------------------- one plan per step


def test_layers_share_one_checked_plan_per_step(monkeypatch, generator):
    """Two steps of two layers each (a prefill and a partitioned decode of 601 tokens): the
    checks run once per step, not once per layer, every layer launches with the step's plan
    (the partition buffers reused), and each layer's output and cache match the reference."""
    calls = {"layer": 0, "decode": 0}

    monkeypatch.setattr(triton_backend, "check_layer_inputs", counted(calls, "layer", triton_backend.check_layer_inputs))
    monkeypatch.setattr(
        triton_backend, "_check_decode_inputs", counted(calls, "decode", triton_backend._check_decode_inputs)
    )
    backend = TritonBackend()
    batch = make_metadata(prefills=[(0, 5)], decodes=[600, 3], block_size=32, generator=generator, device=DEVICE)
    for step in range(2):
        metadata = dataclasses.replace(batch.metadata)  # each step builds a new metadata object
        backend.begin_step(metadata)
        for _ in range(2):
            inputs = make_attention_inputs(batch, num_heads=4, num_kv_heads=2, head_dim=64, generator=generator)
            reference_caches = (inputs.key_cache.clone(), inputs.value_cache.clone())
            expected = TorchReferenceBackend().forward(
                inputs.query, inputs.key, inputs.value, *reference_caches, metadata, 0.125
            )
            out = backend.forward(
                inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, metadata, 0.125
            )
            assert_forward_matches(batch, inputs, out, expected, reference_caches, torch.float32)
        assert calls == {"layer": step + 1, "decode": step + 1}
        assert backend._plan.decode.partition_size == 256


def test_begin_step_rejects_bad_metadata(generator):
    batch = make_metadata(decodes=[5, 9], block_size=16, generator=generator, device=DEVICE)
    with pytest.raises(ValueError, match="metadata.decode_block_tables must be int32 or int64"):
        TritonBackend().begin_step(
            dataclasses.replace(batch.metadata, decode_block_tables=batch.metadata.decode_block_tables.float())
        )


# ---------------------------------------------------------------------------- sliding window, soft-cap


# (heads, block size, window, soft-cap): GQA 1 / 2 / 4 / 8, blocks 8 / 16 / 32, windows smaller
# (5) and larger (20) than a block or none, each at least twice (the interpreter is slow)
MASKING_CASES = [
    ((4, 4), 8, 5, None), ((4, 2), 16, 20, 1.5), ((8, 1), 32, None, 1.5),
    ((8, 2), 16, 5, 1.5), ((8, 1), 8, 20, None), ((4, 4), 32, 5, 1.5),
]  # fmt: skip


@pytest.mark.parametrize("variant", ["single", "partitioned"])
@pytest.mark.parametrize("heads, block_size, window, soft_cap", MASKING_CASES)
def test_windowed_soft_capped_attention_matches_dense(heads, block_size, window, soft_cap, variant, generator):
    """Prefill (fresh and over cached context) and decode with a window smaller / larger than
    a block, blocks before every window poisoned with NaN, against float64."""
    from .test_sliding_window import dense_windowed_attention, poison_blocks_before_windows

    batch = make_metadata(prefills=[(0, 12), (9, 4)], decodes=[3, 30], block_size=block_size, generator=generator,
                          device=DEVICE)  # fmt: skip
    inputs = make_attention_inputs(batch, num_heads=heads[0], num_kv_heads=heads[1], head_dim=16, generator=generator)
    scale = 1.0
    expected = dense_windowed_attention(inputs, batch, scale, window or 10**6, soft_cap)
    if window is not None:
        poison_blocks_before_windows(inputs, batch, window)
    backend = TritonBackend()
    out = backend.forward(
        inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, batch.metadata, scale,
        sliding_window=window, soft_cap=soft_cap,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), expected.float(), atol=5e-5, rtol=1e-5)
    decode_out = paged_decode_attention(
        inputs.query[16:], inputs.key_cache, inputs.value_cache, batch.metadata.decode_block_tables,
        batch.metadata.decode_seq_lens, 31, scale, variant=variant, partition_size=16 if variant == "partitioned" else None,
        sliding_window=window, soft_cap=soft_cap,
    )  # fmt: skip
    torch.testing.assert_close(decode_out.cpu(), expected[16:].float(), atol=5e-5, rtol=1e-5)


def test_windows_and_caps_must_be_positive(generator):
    batch = make_metadata(decodes=[3], block_size=8, generator=generator, device=DEVICE)
    inputs = make_attention_inputs(batch, num_heads=2, num_kv_heads=1, head_dim=16, generator=generator)
    args = (inputs.query, inputs.key_cache, inputs.value_cache, batch.metadata.decode_block_tables,
            batch.metadata.decode_seq_lens, 4, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        paged_decode_attention(*args, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap must be positive"):
        paged_decode_attention(*args, soft_cap=-1.0)


def test_warm_up_launches_the_masking_variants_the_model_layers_use(monkeypatch, generator):
    """Layers register their (window, soft-cap) pair with the backend when built; warm_up then
    launches those variants, and a windowed, soft-capped step launches nothing else."""
    from rayserve_paged.models.layers import Attention

    backend = TritonBackend()
    Attention(2, 1, 16, 0.25, backend, sliding_window=8, soft_cap=50.0)  # Gemma 2's sliding layer
    Attention(2, 1, 16, 0.25, backend, soft_cap=50.0)  # and its global one
    assert backend.layer_maskings == {(True, True), (False, True)}
    key_cache, value_cache = randn(generator, 4, 8, 1, 16).to(DEVICE), randn(generator, 4, 8, 1, 16).to(DEVICE)
    asked = {}
    with monkeypatch.context() as patch:  # the backend hands its layers' pairs to warm_up
        patch.setattr(triton_backend, "is_interpreted", lambda: False)
        patch.setattr(triton_backend, "warm_up", lambda *args, **kwargs: asked.update(kwargs) or [])
        backend.warm_up(key_cache, value_cache, num_heads=2)
    assert asked["maskings"] == backend.layer_maskings
    launches: list = []
    for name in KERNEL_NAMES:
        monkeypatch.setattr(triton_kernels, name, ArgumentRecorder(getattr(triton_kernels, name), launches, name))
    monkeypatch.setattr(triton_backend, "is_interpreted", lambda: DEVICE == "cpu")
    launched = triton_backend.warm_up(key_cache, value_cache, num_heads=2, maskings=backend.layer_maskings)
    assert "prefill windowed soft-capped" in launched and "decode single soft-capped" in launched
    assert "prefill" not in launched  # no plain layer
    warmed = {(name, specialization_key(named, NOT_SPECIALIZED[name])) for name, named in launches}
    launches.clear()
    batch = make_metadata(prefills=[(0, 5)], decodes=[20], block_size=8, generator=generator, device=DEVICE,
                          num_blocks=4)  # fmt: skip
    inputs = make_attention_inputs(batch, num_heads=2, num_kv_heads=1, head_dim=16, generator=generator)
    backend.forward(inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache, batch.metadata,
                    0.25, sliding_window=8, soft_cap=50.0)  # fmt: skip
    launched_keys = {(name, specialization_key(named, NOT_SPECIALIZED[name])) for name, named in launches}
    assert launched_keys and launched_keys <= warmed
