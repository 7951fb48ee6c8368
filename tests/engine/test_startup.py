"""Start-up failures say what to change."""

from __future__ import annotations

import pytest

from rayserve_paged import LLM


def test_a_kv_cache_that_cannot_hold_one_sequence_names_the_fix(tiny_paths):
    with pytest.raises(ValueError) as e:
        LLM(model=tiny_paths["opt"], max_model_len=512, num_gpu_blocks_override=4, swap_space_gb=0.01)
    message = str(e.value)
    assert "4 blocks" in message and "max_model_len 512" in message and "kv_cache_memory_gb" in message


def test_a_max_model_len_past_the_models_is_refused(tiny_paths):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(model=tiny_paths["opt"], max_model_len=10**6, kv_cache_memory_gb=0.01)


def test_a_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(Exception) as e:
        LLM(model=str(missing))
    assert "no-such-model" in str(e.value)
