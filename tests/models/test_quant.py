"""The group-quantized linear method against the float32 layer of its dequantized weight.

Every layer is checked under each kernel plan, whatever this machine's own choice: the compiled
float32 kernel (codes kept in its layout at every batch size), the packed int4 kernels
(bfloat16 activations; 8-bit codes as two int4 planes) and the dequantized fallback. Repacking is exact (the codes read back out of the packed form, with the scales and
offsets, dequantize to the checkpoint's values bit for bit); the products are within the
tolerance below of the float32 layer's.
"""

from __future__ import annotations

import pytest
import torch

from rayserve_paged.models import quant
from rayserve_paged.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    ParallelState,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from rayserve_paged.models.quant import COMPILED, KernelPlan, GroupQuantFormat, GroupQuantLinearMethod, QuantizedTensor
from rayserve_paged.ops import cpu_decode, quant_cpu

PACKED = KernelPlan(True, torch.bfloat16, 8, "test: packed")
DEQUANTIZED = KernelPlan(False, torch.float32, 0, "test: dequantized")
requires_compiler = pytest.mark.skipif(cpu_decode.compiler() is None, reason="needs a C++ compiler")
PLANS = [pytest.param(COMPILED, id="compiled", marks=requires_compiler), pytest.param(PACKED, id="packed"),
         pytest.param(DEQUANTIZED, id="dequantized")]  # fmt: skip

# Per element, |quantized - float32| <= BOUND * (|x| @ |W|^T): the packed kernels and the dense
# copy round activations, weights (scales, zeros) and outputs to bfloat16, 2^-9 relative each;
# 2^-7 allows four such roundings of every term of the dot product. The compiled kernel rounds
# nothing below float32: only the summation order differs (2^-16 is ample for K <= 512).
BOUND = 2**-7
FLOAT32_BOUND = 2**-16


def make(out_features: int, in_features: int, bits: int, group_size: int, seed: int = 0) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    codes = torch.randint(0, 2**bits, (out_features, in_features), generator=g).to(torch.uint8)
    scales = (torch.rand(out_features, groups, generator=g) * 0.02 + 0.001).half().float()  # f16 scales, as checkpoints
    offsets = -scales * (2 ** (bits - 1)) + (torch.randn(out_features, groups, generator=g) * 0.01).half().float()
    return QuantizedTensor(codes, scales, offsets)


def load_quantized(layer, q: QuantizedTensor, bits: int, shard_id=None, plan: KernelPlan = PACKED, process=True):
    """Give `layer` the group-quantized method and load the full tensor `q` (a piece of it
    when shard_id is given) through the layer's own load_weight, as the loader does."""
    if not isinstance(layer.method, GroupQuantLinearMethod):
        layer.set_method(GroupQuantLinearMethod(GroupQuantFormat("test", bits, q.group_size), plan))
    args = () if shard_id is None else (shard_id,)
    with torch.no_grad():
        for name, part in zip(quant.QUANT_PARAM_NAMES, (q.codes, q.scales, q.offsets)):
            layer.load_weight(getattr(layer, name), part, *args)
        if process:
            layer.process_weights_after_loading()
    return layer


def assert_close_to_float(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bound: float = BOUND) -> None:
    want = x @ weight.t()
    bound = bound * (x.abs() @ weight.abs().t()) + 1e-6
    excess = ((got - want).abs() - bound).max()
    assert excess <= 0, f"error above the bound by {excess:.3g} (outputs up to {want.abs().max():.3g})"


def test_dequantize_groups_is_scale_times_code_plus_offset():
    codes = torch.tensor([[0, 1, 2, 3], [15, 14, 13, 12]], dtype=torch.uint8)
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    offsets = torch.tensor([[-1.0, 0.0], [3.0, -4.0]])
    assert quant.dequantize_groups(codes, scales, offsets).tolist() == [
        [-1.0, -0.5, 4.0, 6.0],
        [18.0, 17.0, -0.75, -1.0],
    ]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize(
    "out_features, in_features, bits, group_size",
    [(96, 256, 4, 32), (64, 384, 4, 128), (160, 192, 4, 64), (96, 256, 8, 32), (48, 512, 8, 128)],
)
def test_column_layer_equals_its_dequantized_float_layer(out_features, in_features, bits, group_size, plan):
    q = make(out_features, in_features, bits, group_size)
    layer = load_quantized(ColumnParallelLinear(in_features, out_features, bias=False), q, bits, plan=plan)
    weight = q.dequantize()  # [out, in] float32
    assert torch.equal(layer.method.dequantize(layer), weight)  # repacking is exact
    for rows in (1, 3, 8, 9, 33):  # packed kernel up to 8 rows, the dense copy above
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (rows, out_features)
        assert_close_to_float(y, x, weight, FLOAT32_BOUND if plan.is_compiled else BOUND)
    if plan.is_packed:
        assert len(layer.int4_planes) == (1 if bits == 4 else 2) and layer.weight_codes.numel() == 0
    if plan.is_compiled:  # one copy, in the kernel's layout: no checkpoint-form tensors, no dense weight
        assert layer.packed_weight.codes.numel() == -(-out_features // 16) * 16 * in_features * bits // 8
        assert all(getattr(layer, name).numel() == 0 for name in quant.QUANT_PARAM_NAMES)
        assert layer.dense_weight is None and layer.int4_planes == ()


@pytest.mark.parametrize("plan", PLANS[:2])
@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 64)])
def test_tensor_parallel_shards_equal_the_full_layer(bits, group_size, plan):
    """TP=2: column shards concatenate, row shards sum, to the one-rank product; each shard's
    repacked weight is exactly its slice of the full dequantized weight."""
    out_features, in_features = 64, 256
    q = make(out_features, in_features, bits, group_size)
    weight = q.dequantize()
    x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(1))
    column_parts, row_parts = [], []
    for rank in range(2):
        parallel = ParallelState(rank, 2)
        column = load_quantized(ColumnParallelLinear(in_features, out_features, bias=False, parallel=parallel), q, bits,
                                plan=plan)  # fmt: skip
        assert torch.equal(column.method.dequantize(column), weight[rank * 32 : (rank + 1) * 32])
        column_parts.append(column.matmul(x))
        row = load_quantized(RowParallelLinear(in_features, out_features, bias=False, parallel=parallel), q, bits,
                             plan=plan)  # fmt: skip
        assert torch.equal(row.method.dequantize(row), weight[:, rank * 128 : (rank + 1) * 128])
        row_parts.append(row.matmul(x[:, rank * 128 : (rank + 1) * 128]))
    assert_close_to_float(torch.cat(column_parts, dim=-1), x, weight)
    assert_close_to_float(row_parts[0] + row_parts[1], x, weight)


def test_row_shard_that_splits_a_group_is_refused():
    fmt = GroupQuantFormat("test", 4, 128)
    layer = RowParallelLinear(128, 32, bias=False, parallel=ParallelState(0, 2))
    with pytest.raises(ValueError, match="64 input features per rank are not a multiple of the group size 128"):
        layer.set_method(GroupQuantLinearMethod(fmt, PACKED))


@pytest.mark.parametrize("tp_rank, tp_size", [(0, 1), (1, 2)])
def test_fused_qkv_and_gate_up_pieces_land_where_float_ones_do(tp_rank, tp_size):
    """q/k/v (with KV heads) and gate/up pieces: the fused quantized weight is exactly the fused
    float weight of the same pieces, on every rank."""
    parallel = ParallelState(tp_rank, tp_size)
    pieces = {"q": make(4 * 16, 64, 4, 32, seed=1), "k": make(2 * 16, 64, 4, 32, seed=2), "v": make(2 * 16, 64, 4, 32, seed=3)}
    quantized = QKVParallelLinear(64, 16, 4, 2, bias=False, parallel=parallel)
    floats = QKVParallelLinear(64, 16, 4, 2, bias=False, parallel=parallel)
    for shard_id, q in pieces.items():
        load_quantized(quantized, q, 4, shard_id, process=False)
        floats.load_weight(floats.weight, q.dequantize(), shard_id)
    quantized.process_weights_after_loading()
    assert torch.equal(quantized.method.dequantize(quantized), floats.weight)

    up_pieces = [make(96, 64, 8, 32, seed=4), make(96, 64, 8, 32, seed=5)]
    merged = MergedColumnParallelLinear(64, [96, 96], bias=False, parallel=parallel)
    merged_float = MergedColumnParallelLinear(64, [96, 96], bias=False, parallel=parallel)
    for shard_id, q in enumerate(up_pieces):
        load_quantized(merged, q, 8, shard_id, process=False)
        merged_float.load_weight(merged_float.weight, q.dequantize(), shard_id)
    merged.process_weights_after_loading()
    assert torch.equal(merged.method.dequantize(merged), merged_float.weight)


def test_quantized_embedding_looks_up_exact_rows_and_keeps_no_matmul_copy():
    q = make(50, 64, 8, 32)
    embedding = load_quantized(VocabParallelEmbedding(50, 64), q, 8)
    ids = torch.tensor([0, 7, 49, 7])
    assert torch.equal(embedding(ids), q.dequantize()[ids])
    assert embedding.dense_weight is None and embedding.int4_planes == ()  # not tied to an LM head
    shard = load_quantized(VocabParallelEmbedding(50, 64, parallel=ParallelState(1, 2)), q, 8)
    assert torch.equal(shard.method.embed(shard, torch.tensor([0, 24])), q.dequantize()[[25, 49]])


def test_cpu_kernel_plan_is_one_choice_per_process():
    plan = quant.cpu_kernel_plan()
    assert plan is quant.cpu_kernel_plan()
    flags = quant._cpu_flags()
    if "avx512f" in flags and quant_cpu.load() is not None:  # AVX-512 and a C++ compiler: the compiled kernel
        assert plan is COMPILED
        return
    assert plan.is_packed == bool(flags & {"avx512_bf16", "amx_bf16"})
    assert plan.activation_dtype == (torch.bfloat16 if plan.is_packed else torch.float32)


@requires_compiler
def test_tied_lm_head_on_the_compiled_kernel_keeps_one_8_bit_copy():
    """The compiled plan keeps a tied quantized embedding as its codes only (no float32 table):
    lookups dequantize their rows exactly, logits come from the kernel in float32."""
    q = make(50, 64, 8, 32)
    embedding = VocabParallelEmbedding(50, 64)
    head = ParallelLMHead(50, 64, tied_to=embedding)
    embedding.set_method(GroupQuantLinearMethod(GroupQuantFormat("Q8_0", 8, 32), COMPILED))
    load_quantized(embedding, q, 8)
    weight = q.dequantize()
    assert embedding.dense_weight is None and embedding.packed_weight.codes.dtype == torch.uint8
    assert torch.equal(embedding(torch.tensor([3, 49, 3])), weight[[3, 49, 3]])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    logits = head.compute_logits(x)
    assert logits.dtype == torch.float32 and logits.shape == (5, 50)
    assert_close_to_float(logits, x, weight, FLOAT32_BOUND)
    assert torch.equal(embedding.method.dequantize(embedding), weight)
    shard = VocabParallelEmbedding(50, 64, parallel=ParallelState(1, 2))  # rows 25..49, padded to 25
    shard.set_method(GroupQuantLinearMethod(GroupQuantFormat("Q8_0", 8, 32), COMPILED))
    load_quantized(shard, q, 8)
    assert torch.equal(shard.method.embed(shard, torch.tensor([0, 24])), weight[[25, 49]])


def test_tied_lm_head_multiplies_in_float32_and_the_embedding_looks_up_the_same_weight():
    """A tied quantized embedding keeps one float32 copy (its codes go): rows for lookups,
    logits from it in float32 (packed bfloat16 logits change greedy answers)."""
    q = make(50, 64, 8, 32)
    embedding = VocabParallelEmbedding(50, 64)
    head = ParallelLMHead(50, 64, tied_to=embedding)
    load_quantized(embedding, q, 8)
    weight = q.dequantize()
    assert embedding.weight_codes.numel() == 0 and embedding.int4_planes == ()
    assert embedding.dense_weight.dtype == torch.float32
    assert torch.equal(embedding(torch.tensor([3, 49])), weight[[3, 49]])
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(head.compute_logits(x), x @ weight.t(), atol=1e-5, rtol=0)
    assert torch.equal(embedding.method.dequantize(embedding), weight)
    with pytest.raises(ValueError, match="a tied LM head takes the embedding's weight format"):
        head.set_method(quant.UNQUANTIZED)
