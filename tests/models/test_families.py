"""The decoder families against transformers, float32: Llama, Qwen2 (q/k/v biases, mixed
global and sliding layers), Qwen3 (q/k norms, all layers sliding), Mistral (sliding window),
Gemma 2 (alternating sliding / global, attention and final soft-caps, query_pre_attn_scalar,
GeLU-tanh, sandwich (1 + w) norms, scaled embeddings), Gemma 3 text (q/k norms, RoPE per
layer type), Phi-3 (fused qkv_proj / gate_up_proj, all layers sliding).

Windows are 8 tokens; prompts and generations run shorter and longer than the window, on
blocks smaller (4) and larger (16) than it, through the paged runner (chunked prefill, cached
context, TP=2 shards) and the offline engine (prefix caching, swap and recompute preemption).
"""

from __future__ import annotations

import pytest
import torch

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.models.loader import get_model_config, load_model

from .conftest import hf_logits, make_runner, preempting_llm
from .families import FAMILIES, WINDOW, write_family_checkpoint
from .test_tensor_parallel import _generate, _gloo_rank, run_on_ranks

ATOL = 1e-4
SHORT = [1, 77, 78, 79, 80]  # < WINDOW
LONG = [1, *range(300, 320)]  # 21 tokens > 2 * WINDOW
CHUNKED = [1, *range(100, 113)]  # 14 tokens, prefilled 3 per step beside the decodes


@pytest.fixture(scope="module")
def family_checkpoint(tmp_path_factory):
    made = {}

    def make(family, **overrides):
        key = (family, repr(sorted(overrides.items())))
        if key not in made:
            made[key] = str(write_family_checkpoint(family, tmp_path_factory.mktemp(family), **overrides))
        return made[key]

    return make


def _hf_greedy(hf, prompt, max_new_tokens):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("block_size", [4, 16])  # windows of 2 blocks / of half a block
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_hf_generate_with_chunked_prefill(family, block_size, family_checkpoint, hf_model):
    path = family_checkpoint(family)
    assert get_model_config(path).architecture == FAMILIES[family][1]
    hf = hf_model(path)
    runner = make_runner(path, block_size=block_size)
    prompts = {0: SHORT, 1: LONG}
    logits = runner.step(list(prompts.items()))
    generated = {s: [] for s in prompts}
    for step in range(16):  # both sequences end past 2 windows
        for s, row in zip(prompts, logits[-len(prompts) :]):
            generated[s].append(int(row.argmax()))
        chunk = CHUNKED[step * 3 : (step + 1) * 3]
        logits = runner.step([(2, chunk)] if chunk else [], [(s, generated[s][-1]) for s in prompts])
        if chunk:  # a later chunk attends over cached context, inside and past the window
            want = hf_logits(hf, CHUNKED[: (step + 1) * 3])[-1]
            torch.testing.assert_close(logits[0], want, atol=ATOL, rtol=0)
    for s, prompt in prompts.items():
        assert generated[s] == _hf_greedy(hf, prompt, 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_at_every_position_equal_hf(family, family_checkpoint, hf_model):
    path = family_checkpoint(family)
    ours = make_runner(path).step([(0, LONG), (1, SHORT)], all_logits=True)
    want = torch.cat([hf_logits(hf_model(path), LONG), hf_logits(hf_model(path), SHORT)])
    torch.testing.assert_close(ours, want, atol=ATOL, rtol=0)


def test_yarn_scaled_qwen2_equals_hf(family_checkpoint, hf_model):
    """YaRN RoPE (Qwen2.5's long-context setting) past its original 16 positions."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    path = family_checkpoint("qwen2", rope_parameters=rope)
    assert make_runner(path).model.model.layers[0].self_attn.rotary_emb.attention_scaling > 1
    torch.testing.assert_close(
        make_runner(path).step([(0, LONG)], all_logits=True), hf_logits(hf_model(path), LONG), atol=ATOL, rtol=0
    )


def test_tied_gemma2_equals_hf(family_checkpoint, hf_model):
    path = family_checkpoint("gemma2", tie_word_embeddings=True)
    runner = make_runner(path)
    assert runner.model.lm_head.tied_to
    torch.testing.assert_close(
        runner.step([(0, LONG)], all_logits=True), hf_logits(hf_model(path), LONG), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3"])  # phi3: fused q/k/v and gate/up split per rank
def test_two_ranks_together_equal_one_rank(family, family_checkpoint):
    path = family_checkpoint(family)
    expected = _generate(path)
    for rank_logits in run_on_ranks(lambda parallel: _generate(path, parallel), 2):
        for got, want in zip(rank_logits, expected, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_torch_distributed_gloo_two_ranks(family, family_checkpoint, tmp_path):
    """TP=2 over the real collectives (gloo, two processes): one rank's logits."""
    import torch.multiprocessing as mp

    path = family_checkpoint(family)
    out_file = tmp_path / "logits.pt"
    mp.spawn(_gloo_rank, args=(2, path, str(tmp_path / "init"), str(out_file)), nprocs=2, join=True)
    torch.testing.assert_close(torch.load(out_file), _generate(path)[0], atol=ATOL, rtol=0)


def test_phi3_longrope_under_its_old_names_and_with_bad_factors(family_checkpoint, tmp_path):
    """`su` and `yarn` are longrope to Phi3Config; factors of the wrong length fail at load
    naming them."""
    import json
    import shutil

    path = tmp_path / "phi3-longrope"
    shutil.copytree(family_checkpoint("phi3"), path)
    config = json.loads((path / "config.json").read_text())
    head_half = config["head_dim"] // 2
    rope = {"rope_theta": 10000.0, "short_factor": [1.0] * head_half, "long_factor": [2.0] * head_half}
    for name in ("su", "yarn"):
        config["rope_parameters"] = None
        config["rope_scaling"] = {"type": name, **rope}
        (path / "config.json").write_text(json.dumps(config))
        assert get_model_config(path).rope_recompute_len == config["original_max_position_embeddings"] + 1
    config["rope_scaling"] = {"type": "longrope", **rope, "long_factor": [2.0] * (head_half - 1)}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"longrope RoPE needs long_factor with head_dim / 2 = {head_half} entries"):
        load_model(path)


SHARED = "You are a helpful assistant. Answer briefly and precisely, "
PROMPTS = [SHARED + q for q in ("What is a block?", "Why page memory?", "Who wrote this?", "Hi")]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_engine_greedy_equals_hf_with_prefix_cache_chunks_and_preemption(family, mode, family_checkpoint, hf_model):
    path = family_checkpoint(family)
    # 14 blocks of 8 for 4 requests growing to ~50 tokens: preempts; 16-token chunks
    llm = preempting_llm(path, mode, num_blocks=14, max_model_len=96, chunk=16, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    rest = llm.generate(PROMPTS[1:], params, use_tqdm=False)
    assert llm.engine.block_manager.counters.prefix_cache_hits > 0
    counters = llm.engine.scheduler.counters
    assert (counters.preemptions_swap if mode == "swap" else counters.preemptions_recompute) > 0
    hf = hf_model(path)
    for output in first + rest:
        assert output.outputs[0].token_ids == _hf_greedy(hf, output.prompt_token_ids, 28)
    usage = llm.engine.block_manager.usage()
    assert usage.gpu_used == 0 and usage.cpu_used == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_all_windowed_model_frees_blocks_outside_the_window_and_equals_hf(mode, family_checkpoint, hf_model):
    """Mistral's layers are all windowed (12 tokens here): with blocks of 8, a long generation
    holds at most ceil(12 / 8) + 1 = 3 blocks per sequence after each decode slot, exactly,
    under preemption and with prefix caching, and its tokens still equal HF's."""
    window = 12
    path = family_checkpoint("mistral", sliding_window=window)
    assert get_model_config(path).sliding_window == window
    assert get_model_config(family_checkpoint("gemma2")).sliding_window is None  # mixed: nothing freed
    llm = LLM(
        model=path, block_size=8, num_gpu_blocks_override=12, max_model_len=96, preemption_mode=mode,
        swap_space_gb=0.01, kv_cache_memory_gb=0.05, enable_prefix_caching=True, max_num_seqs=4,
    )  # fmt: skip
    bm = llm.engine.block_manager
    assert bm.sliding_window == window
    held: list[int] = []
    append_slots = bm.append_slots

    def recording_append_slots(seq, copies, *lookahead):
        table = append_slots(seq, copies, *lookahead)
        held.append(bm.num_held_blocks(seq))
        return table

    bm.append_slots = recording_append_slots
    params = SamplingParams(temperature=0.0, max_tokens=4 * window, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert max(held) == -(-window // 8) + 1 == 3
    counters = llm.engine.scheduler.counters
    assert (counters.preemptions_swap if mode == "swap" else counters.preemptions_recompute) > 0
    hf = hf_model(path)
    for output in outputs:
        assert output.outputs[0].token_ids == _hf_greedy(hf, output.prompt_token_ids, 4 * window)
    assert bm.usage().gpu_used == 0 and bm.usage().cpu_used == 0
