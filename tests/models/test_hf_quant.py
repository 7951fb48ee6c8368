"""AWQ and GPTQ int4 checkpoints written here (random 4-bit weights with float16 scales and
zero points on the tiny Llama) against their float32 twins: the same model with each linear
weight dequantized by the formats' own formula, W = scale * (q - zero).

The packers below follow the formats' published layouts, one nibble at a time, independently
of the loader's vectorised unpacking.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rayserve_paged.models import quant
from rayserve_paged.models.hf_quant import AWQ_ORDER
from rayserve_paged.models.loader import get_model_config, load_model
from rayserve_paged.models.quant import GroupQuantLinearMethod
from rayserve_paged.models.tiny import make_tiny_model
from rayserve_paged.ops import cpu_decode

from .paged import PagedRunner
from .test_tensor_parallel import ThreadCollectives, ThreadParallelState

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32}  # fmt: skip


PLANS = {"packed": quant.KernelPlan(True, torch.bfloat16, 4, "test"), "compiled": quant.COMPILED}


@pytest.fixture(autouse=True, params=[
    "packed", pytest.param("compiled", marks=pytest.mark.skipif(cpu_decode.compiler() is None, reason="no C++ compiler"))])
def kernel_plan(request, monkeypatch):
    """Each CPU plan with codes kept, whatever this CPU is (the fallback plan has its own test)."""
    monkeypatch.setattr(quant, "cpu_kernel_plan", lambda: PLANS[request.param])


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-128"), **SIZES)


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values in [0, 16) -> int32 words, nibble i at bits 4i..4i+3."""
    words = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        words |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def pack_gptq(q: np.ndarray, zeros: np.ndarray, v1: bool) -> dict[str, np.ndarray]:
    """q [out, in], zeros [in / g, out] -> qweight [in / 8, out] (eight input features per
    word), qzeros [in / g, out / 8] (eight output features per word; zero - 1 in v1)."""
    out_features, in_features = q.shape
    qweight = _words(q.T.reshape(in_features // 8, 8, out_features).transpose(0, 2, 1))
    stored = zeros - 1 if v1 else zeros
    qzeros = _words(stored.reshape(zeros.shape[0], out_features // 8, 8))
    return {"qweight": qweight, "qzeros": qzeros}


def pack_awq(q: np.ndarray, zeros: np.ndarray) -> dict[str, np.ndarray]:
    """q [out, in] -> qweight [in, out / 8]: nibble i of word j is output feature 8j + AWQ_ORDER[i]."""
    def pack(values: np.ndarray) -> np.ndarray:  # [rows, out]
        grouped = values.reshape(values.shape[0], -1, 8)
        return _words(grouped[..., list(AWQ_ORDER)])

    return {"qweight": pack(q.T), "qzeros": pack(zeros)}


def write_quantized(base_dir, out_dir, method: str, group_size: int, symmetric: bool, seed: int = 0,
                    quantize_config_file: bool = False, gptq_v1: bool = True):
    """(quantized checkpoint dir, float32 twin dir) of base_dir's tiny Llama."""
    rng = np.random.default_rng(seed)
    config = json.loads((base_dir / "config.json").read_text())
    tensors = load_file(str(base_dir / "model.safetensors"))
    quantized, twin = {}, {}
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if not any(prefix.endswith(linear) for linear in LINEARS):
            quantized[name] = twin[name] = tensor
            continue
        out_features, in_features = tensor.shape
        groups = in_features // group_size
        q = rng.integers(0, 16, (out_features, in_features))
        # GPTQ's original format stores zero - 1 in a nibble: zero 0 is not representable there
        lowest_zero = 1 if method == "gptq" and gptq_v1 else 0
        zeros = np.full((groups, out_features), 8) if symmetric else rng.integers(lowest_zero, 16, (groups, out_features))
        scales = (rng.random((groups, out_features)) * 0.02 + 0.002).astype(np.float16)  # [in / g, out]
        g_of_k = np.arange(in_features) // group_size
        weight = scales.astype(np.float32)[g_of_k].T * (q - zeros[g_of_k].T)  # [out, in]
        twin[name] = torch.from_numpy(weight.astype(np.float32))
        packed = pack_awq(q, zeros) if method == "awq" else pack_gptq(q, zeros, gptq_v1)
        for part, values in packed.items():
            quantized[f"{prefix}.{part}"] = torch.from_numpy(values)
        quantized[f"{prefix}.scales"] = torch.from_numpy(scales)
        if method == "gptq":
            quantized[f"{prefix}.g_idx"] = torch.from_numpy(g_of_k.astype(np.int32))
    qc = {"quant_method": method, "bits": 4, "group_size": group_size}
    if method == "awq":
        qc |= {"version": "gemm", "zero_point": True}
    else:
        qc |= {"desc_act": False, "sym": symmetric, "checkpoint_format": "gptq" if gptq_v1 else "gptq_v2"}
    dirs = []
    for kind, weights in (("quantized", quantized), ("twin", twin)):
        path = out_dir / kind
        path.mkdir()
        cfg = dict(config, dtype="float16") if kind == "quantized" else config
        if kind == "quantized" and not quantize_config_file:
            cfg = dict(cfg, quantization_config=qc)
        elif kind == "quantized":
            (path / "quantize_config.json").write_text(json.dumps({k: v for k, v in qc.items() if k != "quant_method"}))
        (path / "config.json").write_text(json.dumps(cfg))
        (path / "generation_config.json").write_text((base_dir / "generation_config.json").read_text())
        save_file(weights, str(path / "model.safetensors"))
        dirs.append(path)
    return dirs


def _logits(path, parallel=None, **kwargs) -> list[torch.Tensor]:
    """A packed prefill of two prompts (9 rows: the dense copy) and two decode steps (2 rows:
    the packed kernel)."""
    config = get_model_config(path)
    tp_size = parallel.tp_size if parallel else 1
    model = load_model(path, dtype=torch.float32, parallel=parallel, **kwargs)
    runner = PagedRunner(model, config.num_layers, config.num_kv_heads_per_rank(tp_size), config.head_dim)
    prompts = {0: [1, 40, 41, 42, 43, 44], 1: [1, 9, 8]}
    logits = [runner.step(list(prompts.items()))]
    for _ in range(2):
        logits.append(runner.step([], list(zip(prompts, logits[-1].argmax(-1).tolist()))))
    return logits


def assert_logits_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Within 2% of the largest float32 logit (bfloat16 activations in the linear layers)."""
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0.02 * w.abs().max().item(), rtol=0)


CASES = [("awq", 32, False), ("awq", 128, False), ("gptq", 64, True), ("gptq", 128, False)]


@pytest.mark.parametrize("method, group_size, symmetric", CASES)
def test_checkpoint_loads_and_matches_its_float_twin(method, group_size, symmetric, base_dir, tmp_path):
    quantized_dir, twin_dir = write_quantized(base_dir, tmp_path, method, group_size, symmetric)
    ours = load_model(quantized_dir, dtype=torch.float32)
    twin = load_model(twin_dir, dtype=torch.float32)
    twin_modules = dict(twin.named_modules())
    num_quantized = 0
    for name, module in ours.named_modules():
        if isinstance(getattr(module, "method", None), GroupQuantLinearMethod):
            assert module.method.format == quant.GroupQuantFormat(method, 4, group_size)
            assert torch.equal(module.method.dequantize(module), twin_modules[name].weight), name
            num_quantized += 1
    assert num_quantized == 2 * 4  # qkv, o, gate_up, down per layer; embedding and LM head stay float
    assert_logits_close(_logits(quantized_dir), _logits(twin_dir))
    # quantization "none": the dequantized float path is the twin, exactly
    dequantized = load_model(quantized_dir, dtype=torch.float32, quantization="none").state_dict()
    assert all(torch.equal(dequantized[k], v) for k, v in twin.state_dict().items())


def test_gptq_quantize_config_file_and_v2_zeros(base_dir, tmp_path):
    """An older GPTQ checkpoint: quantize_config.json beside config.json, v2 zero points."""
    quantized_dir, twin_dir = write_quantized(
        base_dir, tmp_path, "gptq", 32, False, seed=3, quantize_config_file=True, gptq_v1=False
    )
    ours = load_model(quantized_dir, dtype=torch.float32)
    layer = ours.model.layers[1].mlp.down_proj
    assert isinstance(layer.method, GroupQuantLinearMethod)
    assert torch.equal(layer.method.dequantize(layer), load_model(twin_dir).model.layers[1].mlp.down_proj.weight)


@pytest.mark.parametrize("method, group_size", [("awq", 32), ("gptq", 64)])
def test_tensor_parallel_ranks_equal_one_rank(method, group_size, base_dir, tmp_path):
    quantized_dir, _ = write_quantized(base_dir, tmp_path, method, group_size, False, seed=1)
    expected = _logits(quantized_dir)
    collectives = ThreadCollectives(2)
    ranks = [ThreadParallelState(rank, 2, collectives=collectives) for rank in range(2)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda parallel: _logits(quantized_dir, parallel), ranks))
    for rank_logits in results:
        assert_logits_close(rank_logits, expected)


def test_checkpoint_kinds_and_bad_configs_are_named(base_dir, tmp_path):
    quantized_dir, twin_dir = write_quantized(base_dir, tmp_path, "awq", 32, False)
    with pytest.raises(ValueError, match="quantization 'gptq' was asked for, but .* is awq"):
        load_model(quantized_dir, quantization="gptq")
    with pytest.raises(ValueError, match="quantization 'awq' was asked for, but .* is not quantized"):
        load_model(twin_dir, quantization="awq")
    config = json.loads((quantized_dir / "config.json").read_text())
    for change, message in [
        ({"bits": 8}, "awq checkpoint with 8-bit weights: only 4-bit is supported"),
        ({"group_size": -1}, "quantization_config.group_size -1"),
        ({"quant_method": "bitsandbytes"}, "unsupported quantization_config.quant_method 'bitsandbytes'"),
    ]:
        bad = dict(config, quantization_config=config["quantization_config"] | change)
        (quantized_dir / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            load_model(quantized_dir)
