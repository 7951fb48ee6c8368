"""enforce_eager (vLLM's name) through the engine: on, every step runs eagerly on its exact
batch; off (the default), decode-only steps run padded on the static-shape path (CUDA graphs
on a GPU, eagerly on CPU). Both give the same tokens: greedy, n > 1 and beam search."""

from __future__ import annotations

import pytest

from rayserve_paged import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Paged attention keeps the cache in blocks",
    "Hello",
    "Paged attention keeps the cache in blocks, and so on",  # a shared prefix (prefix caching)
    "A much longer prompt that runs across more than one block of sixteen tokens, "
    "so that the block tables of this batch have different lengths and shapes",
]


def _run(path: str, enforce_eager: bool):
    llm = LLM(model=path, max_model_len=256, swap_space_gb=0.01, kv_cache_memory_gb=0.05, max_num_seqs=12,
              enforce_eager=enforce_eager)
    runner = llm.engine.executor.worker.runner
    paths: list[str] = []
    execute = runner.execute

    def recording(msg, kv_caches):
        result = execute(msg, kv_caches)
        if msg.seq_ids:
            paths.append(runner.last_path)
        return result

    runner.execute = recording
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    sampled = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=12), use_tqdm=False)
    beams = llm.generate(PROMPTS[1:3], SamplingParams(use_beam_search=True, n=3, temperature=0.0, max_tokens=10),
                         use_tqdm=False)
    tokens = [[c.token_ids for c in o.outputs] for o in (*greedy, *sampled, *beams)]
    return tokens, paths, runner.static_decode


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_enforce_eager_on_and_off_give_the_same_tokens(tiny_paths, arch):
    eager_tokens, eager_paths, no_static = _run(tiny_paths[arch], enforce_eager=True)
    static_tokens, static_paths, static = _run(tiny_paths[arch], enforce_eager=False)
    assert static_tokens == eager_tokens
    assert no_static is None and set(eager_paths) == {"eager"}
    assert static.buckets == (1, 2, 4, 8, 16)
    # decode-only steps ran padded (CPU: no graph), the prefill steps eagerly
    assert "static-eager" in static_paths and "eager" in static_paths and "static-graph" not in static_paths
    assert static.runs["eager"] == static_paths.count("static-eager") > 0
