"""GGUF loading on small synthetic files written with the `gguf` package's writer: every
supported tensor type, llama.cpp's q/k permutation, the header parser, and bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from rayserve_paged.config import EngineConfig
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.models.gguf import SUPPORTED_GGML_TYPES, GGUFError, find_gguf_file, read_gguf_header
from rayserve_paged.models.loader import get_model_config, load_model
from rayserve_paged.models import quant
from rayserve_paged.models.layers import LinearBase
from rayserve_paged.models.quant import UNQUANTIZED, GroupQuantLinearMethod
from rayserve_paged.models.tiny import make_tiny_model

from .paged import PagedRunner

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, *module, suffix = hf_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q and k rows."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, type_name: str) -> np.ndarray:
    """The float32 values a tensor written as `type_name` reads back as."""
    if w.ndim == 1 or type_name == "F32":  # norms stay F32, as llama.cpp writes them
        return w
    qtype = GGMLQuantizationType[type_name]
    return dequantize(quantize(w, qtype), qtype).reshape(w.shape)


def write_gguf(path, hf_dir, type_name: str = "F32", arch: str = "llama", extra=None) -> None:
    """hf_dir's tiny Llama as llama.cpp would convert it, tensors (not norms) as `type_name`."""
    c = json.loads((hf_dir / "config.json").read_text())
    writer = GGUFWriter(str(path), arch)
    add_shape_metadata(writer, c)
    writer.add_token_list([f"tok{i}" for i in range(8)])  # a string array for the header parser
    writer.add_bos_token_id(c["bos_token_id"])
    writer.add_eos_token_id(c["eos_token_id"])
    writer.add_pad_token_id(c["pad_token_id"])
    heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
    for hf_name, tensor in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        w = tensor.numpy()
        proj = hf_name.split(".")[-2]
        if proj in heads:
            w = llama_cpp_permute(w, heads[proj])
        if w.ndim == 1 or type_name == "F32":
            writer.add_tensor(gguf_name(hf_name), w)
        elif type_name == "F16":
            writer.add_tensor(gguf_name(hf_name), w.astype(np.float16))
        else:
            qtype = GGMLQuantizationType[type_name]
            writer.add_tensor(gguf_name(hf_name), quantize(w, qtype), raw_dtype=qtype)
    for name, raw, qtype in extra or ():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_shape_metadata(writer: GGUFWriter, c: dict) -> None:
    """The `<arch>.*` keys llama.cpp writes for a config.json's shape."""
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(c["head_dim"])
    writer.add_rope_dimension_count(c["head_dim"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(c["vocab_size"])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def f32_gguf(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_gguf(path, llama_dir)
    return path


@pytest.mark.parametrize("type_name", SUPPORTED_GGML_TYPES)
def test_every_supported_type_loads_the_weights_it_holds(type_name, llama_dir, tmp_path):
    """GGUF model == the HF checkpoint whose tensors are what the GGUF type holds, parameter for
    parameter (q/k unpermuted, q/k/v and gate/up fused the same way)."""
    path = tmp_path / f"tiny.{type_name}.gguf"
    write_gguf(path, llama_dir, type_name)
    expected_dir = _expected_checkpoint(llama_dir, tmp_path, type_name)
    ours = load_model(path, dtype=torch.float32, quantization="none").state_dict()
    ref = load_model(expected_dir, dtype=torch.float32).state_dict()
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name


def _expected_checkpoint(llama_dir, tmp_path, type_name):
    """The HF checkpoint whose float32 tensors are what a GGUF file of `type_name` holds."""
    expected_dir = tmp_path / "expected"
    expected_dir.mkdir()
    for name in ("config.json", "generation_config.json"):
        (expected_dir / name).write_text((llama_dir / name).read_text())
    weights = load_file(str(llama_dir / "model.safetensors"))
    save_file({n: torch.from_numpy(roundtrip(t.numpy(), type_name)) for n, t in weights.items()},
              str(expected_dir / "model.safetensors"))  # fmt: skip
    return expected_dir


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_kept_quantized_types_repack_exactly(type_name, llama_dir, tmp_path, monkeypatch):
    """quantization auto keeps Q4_0 / Q4_1 / Q8_0 packed (under the packed-kernel plan, whatever
    this CPU is): every layer's repacked weight dequantizes to the GGUF's dequantized values bit
    for bit (q/k unpermuted, q/k/v and gate/up fused), and the logits stay within 2% of the
    largest float32 logit (bfloat16 activations in the linear layers, logits in float32)."""
    monkeypatch.setattr(quant, "cpu_kernel_plan", lambda: quant.KernelPlan(True, torch.bfloat16, 8, "test"))
    path = tmp_path / f"tiny.{type_name}.gguf"
    write_gguf(path, llama_dir, type_name)
    ours = load_model(path, dtype=torch.float32)
    ref = load_model(_expected_checkpoint(llama_dir, tmp_path, type_name), dtype=torch.float32)
    ref_modules = dict(ref.named_modules())
    num_quantized = 0
    for name, module in ours.named_modules():
        if isinstance(module, LinearBase) and not getattr(module, "tied_to", ()):
            assert isinstance(module.method, GroupQuantLinearMethod), name
            assert torch.equal(module.method.dequantize(module), ref_modules[name].weight), name
            num_quantized += 1
    assert num_quantized == 2 * 4 + 2  # per layer qkv, o, gate_up, down; the embedding and the LM head
    assert len(ours.model.layers[0].mlp.down_proj.int4_planes) == (2 if type_name == "Q8_0" else 1)
    config = get_model_config(path)
    prompts = {0: [1, 40, 41, 42, 43, 44], 1: [1, 9, 8]}
    logits = []
    for model in (ours, ref):
        runner = PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_dim)
        logits.append(runner.step(list(prompts.items()), all_logits=True))  # 9 rows: the dense copy
        logits.append(runner.step([], [(0, 5), (1, 6)]))  # 2 rows: the packed kernel
    for got, want in ((logits[0], logits[2]), (logits[1], logits[3])):
        torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)


def test_other_quantized_types_are_dequantized(llama_dir, tmp_path):
    path = tmp_path / "tiny.Q5_1.gguf"
    write_gguf(path, llama_dir, "Q5_1")
    model = load_model(path, dtype=torch.float32)
    assert all(
        module.method is UNQUANTIZED for module in model.modules() if isinstance(module, LinearBase)
    )


def test_f32_gguf_is_the_hf_checkpoint(llama_dir, f32_gguf):
    ours = load_model(f32_gguf, dtype=torch.float32).state_dict()
    ref = load_model(llama_dir, dtype=torch.float32).state_dict()
    assert all(torch.equal(ours[name], ref[name]) for name in ref)
    assert get_model_config(f32_gguf) == get_model_config(llama_dir)


def test_header_parser_agrees_with_gguf_reader(f32_gguf):
    header = read_gguf_header(f32_gguf)
    reader = GGUFReader(str(f32_gguf))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.metadata.keys() == fields.keys()
    for key, value in fields.items():
        assert header.metadata[key] == pytest.approx(value), key
    assert header.metadata["tokenizer.ggml.tokens"] == [f"tok{i}" for i in range(8)]
    assert [t.name for t in reader.tensors] == list(header.tensors)
    for t in reader.tensors:
        ours = header.tensors[t.name]
        assert (ours.offset, ours.num_bytes, ours.ggml_type) == (t.data_offset, t.n_bytes, t.tensor_type)
        assert ours.shape == tuple(reversed(t.shape.tolist()))


def test_a_directory_holding_one_gguf_file_is_that_file(f32_gguf, tmp_path):
    assert find_gguf_file(f32_gguf.parent) == f32_gguf
    (tmp_path / "a.gguf").write_bytes(f32_gguf.read_bytes())
    (tmp_path / "b.gguf").write_bytes(f32_gguf.read_bytes())
    with pytest.raises(FileNotFoundError, match="several GGUF files"):
        find_gguf_file(tmp_path)


# --------------------------------------------------------------------------- bad files


def _start_engine(path, tokenizer_dir):
    return LLMEngine(EngineConfig(model=str(path), tokenizer=str(tokenizer_dir), device="cpu", max_model_len=64))


def test_truncated_file_fails_at_start_up(f32_gguf, llama_dir, tmp_path):
    data = f32_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(GGUFError, match=r"truncated GGUF file: tensor '[^']+' needs bytes up to \d+"):
        _start_engine(cut, llama_dir)
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(GGUFError, match="truncated GGUF header"):
        get_model_config(cut)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        get_model_config(path)


def test_unknown_architecture_fails_at_start_up(llama_dir, tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, llama_dir, arch="mamba")
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'mamba'; supported: llama"):
        _start_engine(path, llama_dir)


def test_unsupported_quantization_fails_at_start_up_naming_the_type(llama_dir, tmp_path):
    path = tmp_path / "q4k.gguf"
    q4_k = np.zeros((4, 144), dtype=np.uint8)  # 4 rows of one 256-value Q4_K block
    write_gguf(path, llama_dir, extra=[("blk.0.extra.weight", q4_k, GGMLQuantizationType.Q4_K)])
    with pytest.raises(GGUFError, match="'blk.0.extra.weight' uses GGUF quantization type Q4_K, which is not supported"):
        _start_engine(path, llama_dir)
