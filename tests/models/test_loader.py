"""load_model / get_model_config: formats, dtypes, and errors that name the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rayserve_paged.models.llama import LlamaForCausalLM
from rayserve_paged.models.loader import WeightLoadError, get_model_config, load_model, resolve_dtype
from rayserve_paged.models.opt import OPTForCausalLM

from .conftest import make_runner
from .paged import PagedRunner


@pytest.fixture
def llama_copy(tiny_checkpoint, tmp_path):
    """A private, editable copy of tiny-llama."""
    return shutil.copytree(tiny_checkpoint("llama"), tmp_path / "llama")


def _edit_weights(path, edit) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors")


def _edit_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_loads_both_architectures(tiny_checkpoint):
    assert isinstance(load_model(tiny_checkpoint("opt")), OPTForCausalLM)
    model = load_model(tiny_checkpoint("llama"), dtype="auto", device="cpu", attn_backend="torch")
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_model_config(tiny_checkpoint):
    config = get_model_config(tiny_checkpoint("llama"))
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert (config.vocab_size, config.max_model_len, config.dtype) == (512, 2048, "float32")
    assert (config.eos_token_ids, config.eos_token_id, config.bos_token_id) == ((2,), 2, 1)
    assert config.num_kv_heads_per_rank(2) == 1 and config.num_kv_heads_per_rank(4) == 1
    opt = get_model_config(tiny_checkpoint("opt"))
    assert (opt.architecture, opt.num_kv_heads, opt.head_dim, opt.max_model_len) == ("OPTForCausalLM", 4, 16, 2048)


def test_eos_ids_merge_generation_config_and_old_dtype_key(llama_copy):
    _edit_config(llama_copy, dtype=None, torch_dtype="bfloat16")
    (llama_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 6]}))
    config = get_model_config(llama_copy)
    assert config.eos_token_ids == (2, 6)
    assert config.dtype == "bfloat16" and config.torch_dtype == torch.bfloat16


def test_dtype_names():
    assert resolve_dtype("half", {}) == torch.float16
    assert resolve_dtype("auto", {"dtype": "bfloat16"}) == torch.bfloat16
    assert resolve_dtype(None, {"torch_dtype": "float16"}) == torch.float16
    assert resolve_dtype(None, {}) == torch.float32
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", {})


def test_bfloat16_load_tracks_float32(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompt = [1, 10, 20, 30, 40, 50]
    ref = make_runner(path).step([(0, prompt)])
    config = get_model_config(path)
    model = load_model(path, dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    runner = PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_dim, dtype=torch.bfloat16)
    ours = runner.step([(0, prompt)])
    assert ours.dtype == torch.float32
    assert ours.argmax() == ref.argmax()
    torch.testing.assert_close(ours, ref, atol=0.3, rtol=0)


def test_pytorch_bin_checkpoint_loads_the_same(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("opt")
    path = shutil.copytree(source, tmp_path / "opt-bin")
    weights = load_file(path / "model.safetensors")
    # facebook/opt-* .bin files were saved from OPTModel: names start at "decoder."
    renamed = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
    torch.save(renamed, path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    prompt = [1, 5, 6, 7, 8]
    torch.testing.assert_close(make_runner(path).step([(0, prompt)]), make_runner(source).step([(0, prompt)]))


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="no/such/model-dir"):
        load_model("no/such/model-dir")
    with pytest.raises(FileNotFoundError, match="no/such/model-dir"):
        get_model_config("no/such/model-dir")


def test_missing_config_and_weights(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model weights"):
        load_model(llama_copy)
    (llama_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(llama_copy)


def test_wrong_shape_names_the_tensor_and_shapes(llama_copy):
    name = "model.layers.1.self_attn.k_proj.weight"  # [2 heads * 16, 64]
    _edit_weights(llama_copy, lambda w: w.__setitem__(name, torch.zeros(48, 64)))
    with pytest.raises(WeightLoadError, match=r"k_proj.weight.*\[48, 64\].*expected shape \[32, 64\]"):
        load_model(llama_copy)


def test_wrong_shape_in_a_row_parallel_layer(llama_copy):
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 128]
    _edit_weights(llama_copy, lambda w: w.__setitem__(name, torch.zeros(64, 100)))
    with pytest.raises(WeightLoadError, match=r"'model.layers.0.mlp.down_proj.weight'.*\[64, 100\]"):
        load_model(llama_copy)


def test_missing_tensor_is_named(llama_copy):
    _edit_weights(llama_copy, lambda w: w.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"model.layers.0.mlp.gate_up_proj.weight \(shard 1\)"):
        load_model(llama_copy)


def test_untied_checkpoint_without_lm_head_is_an_error(llama_copy):
    _edit_weights(llama_copy, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(WeightLoadError, match="lm_head.weight"):
        load_model(llama_copy)
    _edit_config(llama_copy, tie_word_embeddings=True)  # declared tied: the embedding serves
    load_model(llama_copy)


def test_unsupported_architecture(llama_copy):
    _edit_config(llama_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: OPTForCausalLM, LlamaForCausalLM"):
        load_model(llama_copy)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_config(llama_copy)


def test_unsupported_rope_type(llama_copy):
    # `su` is an old name of longrope that only Phi-3 configs use
    _edit_config(llama_copy, rope_parameters={"rope_type": "su", "rope_theta": 10000.0, "factor": 4.0})
    supported = "default, linear, llama3, yarn, dynamic, longrope"
    with pytest.raises(ValueError, match=f"unsupported RoPE type .su.; supported: {supported}"):
        load_model(llama_copy)
