"""GGUF files of the decoder families (`qwen2`, `qwen3`, `gemma2`) and Llama 3.1+ (`rope_freqs`,
llama3 RoPE scaling), written with the `gguf` package the way llama.cpp's converter lays
them out, load to exactly the HF checkpoint's weights and logits; GGUF at TP=2."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from rayserve_paged.models.loader import get_model_config, load_model

from .conftest import make_runner
from .families import write_family_checkpoint
from .test_gguf import add_shape_metadata, llama_cpp_permute
from .paged import PagedRunner
from .test_tensor_parallel import run_on_ranks

LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones
}  # fmt: skip
GEMMA2_LAYER_NAMES = {
    **LAYER_NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip


def gguf_tensor_name(hf_name: str, arch: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, *module, suffix = hf_name.split(".")
    names = GEMMA2_LAYER_NAMES if arch in ("gemma2", "gemma3") else LAYER_NAMES
    return f"blk.{layer}.{names['.'.join(module)]}.{suffix}"


def llama3_rope_freqs(c: dict) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs for llama3 scaling."""
    params, head_dim = c["rope_parameters"], c["head_dim"]
    base, factor = params["rope_theta"], params["factor"]
    low, high, old = params["low_freq_factor"], params["high_freq_factor"], params["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, hf_dir, arch: str, type_name: str = "F32") -> None:
    c = json.loads((hf_dir / "config.json").read_text())
    rope = c["rope_parameters"].get("full_attention")  # Gemma 3: the global layers' RoPE
    if rope is not None:
        c["rope_parameters"] = rope
    writer = GGUFWriter(str(path), arch)
    add_shape_metadata(writer, c)
    if rope is not None and rope["rope_type"] == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    writer.add_bos_token_id(c["bos_token_id"])
    writer.add_eos_token_id(c["eos_token_id"])
    if arch == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", c["attn_logit_softcapping"])
        writer.add_float32("gemma2.final_logit_softcapping", c["final_logit_softcapping"])
    if c.get("sliding_window"):
        writer.add_uint32(f"{arch}.attention.sliding_window", c["sliding_window"])
    if c["rope_parameters"].get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(c))
    if c["rope_parameters"].get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter
        original = c["original_max_position_embeddings"]
        scale = c["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(c["rope_parameters"]["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(c["rope_parameters"]["short_factor"], dtype=np.float32))
    heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
    for hf_name, tensor in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        w = tensor.numpy()
        if arch == "llama" and hf_name.split(".")[-2] in heads:
            w = llama_cpp_permute(w, heads[hf_name.split(".")[-2]])
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp multiplies by the stored weight: it stores 1 + w
        if w.ndim == 1 or type_name == "F32":
            writer.add_tensor(gguf_tensor_name(hf_name, arch), w)
        else:
            qtype = GGMLQuantizationType[type_name]
            writer.add_tensor(gguf_tensor_name(hf_name, arch), quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def family_gguf(tmp_path_factory):
    made = {}

    def make(family, type_name="F32", **overrides):
        key = (family, type_name, repr(sorted(overrides.items())))
        if key not in made:
            hf_dir = write_family_checkpoint(family, tmp_path_factory.mktemp(family), **overrides)
            path = hf_dir.parent / f"{family}.{type_name}.gguf"
            write_gguf(path, hf_dir, "llama" if family == "llama" else family, type_name)
            made[key] = (hf_dir, path)
        return made[key]

    return make


PROMPTS = [(0, [1, *range(300, 320)]), (1, [1, 77, 78])]


# llama.cpp keeps no query_pre_attn_scalar (Gemma 2 2B / 9B, Gemma 3 but 27B: head_dim) and
# fixes Gemma 3's sliding pattern (5:1) and local RoPE base (10000)
GGUF_OVERRIDES = {"qwen2": {"use_sliding_window": False}, "qwen3": {"use_sliding_window": False},
                  "gemma2": {"query_pre_attn_scalar": 16}, "gemma3": {"query_pre_attn_scalar": 16,
                  "sliding_window_pattern": 6}, "phi3": {}, "llama": {}}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_f32_gguf_is_the_hf_checkpoint(family, family_gguf):
    overrides = GGUF_OVERRIDES[family]
    hf_dir, path = family_gguf(family, **overrides)
    config = get_model_config(path)
    assert config.architecture == get_model_config(hf_dir).architecture
    assert config.sliding_window == get_model_config(hf_dir).sliding_window
    ours, ref = load_model(path, dtype=torch.float32), load_model(hf_dir, dtype=torch.float32)
    # GGUF keeps eps as float32 and no layer_types for all-global models: same windows
    assert ours.config.layer_windows == ref.config.layer_windows
    assert ours.config.rms_norm_eps == pytest.approx(ref.config.rms_norm_eps, rel=1e-6)
    assert replace(ours.config, rms_norm_eps=ref.config.rms_norm_eps, layer_types=ref.config.layer_types) == ref.config
    state, ref_state = ours.state_dict(), ref.state_dict()
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(make_runner(path).step(PROMPTS, all_logits=True),
                               make_runner(hf_dir).step(PROMPTS, all_logits=True), atol=1e-5, rtol=0)  # fmt: skip


def test_llama31_gguf_rope_freqs_equal_llama3_scaling(family_gguf, tmp_path):
    """Llama 3.1+ GGUFs carry llama3 RoPE scaling as per-dimension factors (rope_freqs)."""
    from .conftest import hf_logits
    from transformers import AutoModelForCausalLM

    from rayserve_paged.models.tiny import make_tiny_model
    from .test_gguf import write_gguf as write_llama_gguf

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    hf_dir = make_tiny_model("llama", tmp_path / "llama31", rope_parameters=rope)
    path = tmp_path / "llama31.gguf"
    c = json.loads((hf_dir / "config.json").read_text())
    write_llama_gguf(path, hf_dir, extra=[("rope_freqs.weight", llama3_rope_freqs(c), GGMLQuantizationType.F32)])
    model = load_model(path, dtype=torch.float32)
    factors = model.model.layers[0].self_attn.rotary_emb.rope.freq_factors
    assert factors == tuple(llama3_rope_freqs(c).tolist()) and max(factors) == 8.0 > min(factors)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = [1, *range(300, 340)]  # 41 positions: past the 16 original ones
    torch.testing.assert_close(make_runner(path).step([(0, prompt)], all_logits=True), hf_logits(hf, prompt),
                               atol=1e-4, rtol=0)  # fmt: skip


def test_phi3_longrope_gguf_generates_the_hf_tokens(family_gguf, hf_model):
    """llama.cpp's Phi-3 LongRoPE file (rope_factors_long / _short, the original context
    length and the attention factor in the metadata): greedy tokens equal transformers'
    `generate` on the checkpoint it came from, below, across and above the original length."""
    from rayserve_paged import LLM, SamplingParams

    from .test_rope_by_length import CHECKPOINTS, MAX_TOKENS, PROMPTS, THRESHOLD, _hf_greedy

    hf_dir, path = family_gguf("phi3", **CHECKPOINTS["phi3-longrope"][1])
    config = get_model_config(path)
    assert (config.max_model_len, config.rope_recompute_len) == (4 * THRESHOLD, THRESHOLD + 1)
    ours = load_model(path).model.layers[0].self_attn.rotary_emb
    ref = load_model(hf_dir).model.layers[0].self_attn.rotary_emb
    assert (ours.rope.short_factor, ours.rope.long_factor) == (ref.rope.short_factor, ref.rope.long_factor)
    assert ours.attention_scaling == pytest.approx(ref.attention_scaling, rel=1e-6) and ours.attention_scaling > 1
    llm = LLM(model=str(path), tokenizer=str(hf_dir), block_size=8, kv_cache_memory_gb=0.05, max_model_len=64,
              enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=3)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    hf = hf_model(str(hf_dir))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.outputs[0].token_ids == _hf_greedy(hf, prompt, MAX_TOKENS)


def _logits(path, parallel=None, quantization="auto") -> torch.Tensor:
    """Prefill logits of two prompts at one rank or on `parallel`'s."""
    config = get_model_config(path)
    tp_size = parallel.tp_size if parallel else 1
    model = load_model(path, parallel=parallel, quantization=quantization)
    return PagedRunner(model, config.num_layers, config.num_kv_heads_per_rank(tp_size), config.head_dim).step(PROMPTS)


@pytest.mark.parametrize("family, type_name", [("qwen2", "Q8_0"), ("llama", "Q8_0"), ("gemma2", "F32"), ("phi3", "Q8_0")])
def test_gguf_at_two_ranks_equals_one_rank(family, type_name, family_gguf):
    """Dequantized, the shards of two ranks give one rank's logits exactly; kept quantized
    (Q8_0 codes, bfloat16 activations in the packed kernels) within that path's rounding,
    which at one rank is of the same size against the float weights (~0.03 here)."""
    _, path = family_gguf(family, type_name, **GGUF_OVERRIDES[family])
    want = _logits(path, quantization="none")
    for got in run_on_ranks(lambda parallel: _logits(path, parallel, "none"), 2):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if type_name != "F32":
        want = _logits(path)
        for got in run_on_ranks(lambda parallel: _logits(path, parallel), 2):
            torch.testing.assert_close(got, want, atol=0.1, rtol=0)
