"""`rayserve-paged bench sampler-host` writes its figures, and times a baseline sampler of the
old call shape beside the current one (never asserts speed)."""

from __future__ import annotations

import json

import pytest

from rayserve_paged.cli import main

# A sampler with the call shape before SamplingBatch: (logits, groups, group_params).
OLD_SHAPE = '''
from rayserve_paged.models import sampler
from rayserve_paged.worker.sampling_inputs import row_template, sampling_batch

class Sampler(sampler.Sampler):
    def __call__(self, logits, groups, group_params):
        rows = [(row_template(p, self.eos_token_ids), s.seq_id, s.sample_index, s.num_output_tokens, 1, None,
                 g.num_prompt_tokens) for g, p in zip(groups, group_params) for s in g.seqs]
        return super().__call__(logits, sampling_batch(rows))
'''

WRONG_TOKENS = OLD_SHAPE.replace("return super().__call__(logits, sampling_batch(rows))",
                                 "return super().__call__(-logits, sampling_batch(rows))")


def test_sampler_host_benchmark_writes_json_with_the_baseline_beside(tmp_path):
    baseline = tmp_path / "sampler_before.py"
    baseline.write_text(OLD_SHAPE)
    argv = ["bench", "sampler-host", "--steps", "2", "--warmup", "1", "--baseline-sampler", str(baseline)]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "sampler_host.json").read_text())
    assert set(record["results"]) == {"greedy_256", "sampled_256"}
    for row in record["results"].values():
        assert row["build_us"] > 0 and row["total_us"] >= row["build_us"] and row["baseline_total_us"] > 0


def test_a_baseline_that_picks_other_greedy_tokens_is_refused(tmp_path):
    baseline = tmp_path / "sampler_wrong.py"
    baseline.write_text(WRONG_TOKENS)
    with pytest.raises(AssertionError, match="other greedy tokens"):
        main(["bench", "sampler-host", "--steps", "1", "--warmup", "0", "--cases", "greedy_256",
              "--baseline-sampler", str(baseline)])
