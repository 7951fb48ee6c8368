"""Tiny checkpoints: deterministic bytes, HF-loadable, a working tokenizer, a safe cache."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rayserve_paged.models import tiny
from rayserve_paged.models.tiny import make_tiny_model, resolve_model


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_same_call_gives_same_bytes(arch, tmp_path):
    first = make_tiny_model(arch, tmp_path / "a")
    second = make_tiny_model(arch, tmp_path / "b")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_seed_changes_weights(tmp_path):
    a = make_tiny_model("opt", tmp_path / "a", seed=0)
    b = make_tiny_model("opt", tmp_path / "b", seed=1)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "arch, overrides",
    [("opt", {}), ("opt", {"tie_word_embeddings": True}), ("llama", {}), ("llama", {"tie_word_embeddings": True})],
)
def test_hf_loads_every_weight(arch, overrides, tiny_checkpoint):
    path = tiny_checkpoint(arch, **overrides)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert model.config.vocab_size == tiny.TINY_VOCAB_SIZE


def test_tokenizer_round_trips_and_has_specials(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    assert len(tokenizer) == tiny.TINY_VOCAB_SIZE
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = "The captain looked at the map, and smiled: 42 ships!"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) < len(text)  # BPE merges learned from the corpus
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer("naïve café ☕", add_special_tokens=False)["input_ids"]) == "naïve café ☕"


def test_chat_template(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("opt"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") in ids  # one token, not split


def test_greedy_output_is_not_degenerate(tiny_checkpoint, hf_model):
    for arch in ("opt", "llama"):
        model = hf_model(tiny_checkpoint(arch))
        outputs = []
        for prompt in ([1, 40, 41, 42], [1, 300, 301]):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
            outputs.append(out[0, len(prompt):].tolist())
        assert outputs[0] != outputs[1]
        assert all(len(set(tokens)) >= 5 for tokens in outputs), outputs


def test_resolve_model_builds_cache_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSERVE_PAGED_CACHE", str(tmp_path / "cache"))
    path = resolve_model("tiny-llama")
    assert path == tmp_path / "cache" / "tiny-llama"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny-llama") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == ["tiny-llama"]  # no temp dirs left


def test_resolve_model_loses_a_race_cleanly(tmp_path, monkeypatch):
    """Another process finishes first: our rename fails, we discard our copy and use theirs."""
    monkeypatch.setenv("RAYSERVE_PAGED_CACHE", str(tmp_path))
    real_make = tiny.make_tiny_model

    def make_while_another_process_wins(arch, out_dir, **kwargs):
        real_make(arch, tmp_path / "tiny-opt")  # the other process's rename lands first
        return real_make(arch, out_dir, **kwargs)

    monkeypatch.setattr(tiny, "make_tiny_model", make_while_another_process_wins)
    assert resolve_model("tiny-opt") == tmp_path / "tiny-opt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-opt"]


def test_resolve_model_local_dir_and_unknown(tmp_path, monkeypatch):
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="no-such-org/no-such-model"):
        resolve_model("no-such-org/no-such-model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(os.fspath(tmp_path / "missing" / "dir"))
