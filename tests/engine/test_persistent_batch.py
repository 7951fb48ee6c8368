"""The worker's persistent batch mirrors the scheduler exactly, step by step, through
preemption (swap and recompute), chunked prefill, prefix caching, forks (n > 1, beam
search) and penalties; and holds nothing once every request has ended."""

from __future__ import annotations

import random

import pytest

from rayserve_paged import LLM, SamplingParams


class MirrorCheck:
    """Wraps the in-process executor: after every step, each row's block table and token
    history on the worker equal the scheduler's, and the worker holds exactly the
    requests the scheduler has sent and not yet ended."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.executor = llm.engine.executor
        self.batch = self.executor.worker.runner.batch
        self.real_execute = self.executor.execute
        self.executor.execute = self.execute
        self.num_steps = 0
        self.num_rows = 0
        self.num_updates = 0
        self.num_forks = 0

    def execute(self, msg):
        result = self.real_execute(msg)
        scheduler = self.engine.scheduler
        tables = self.engine.block_manager.gpu_tables
        seqs = {s.seq_id: s for g in scheduler.groups.values() for s in g.seqs}
        for i, seq_id in enumerate(msg.seq_ids):
            state = self.batch.seqs[seq_id]
            assert state.block_table == tables[seq_id], f"step {self.num_steps}: table of sequence {seq_id}"
            if state.history is not None:
                end = msg.start_positions[i] + msg.num_query_tokens[i]
                assert state.history == seqs[seq_id].token_ids[:end]
        assert set(self.batch.requests) <= set(scheduler.groups) | set(scheduler._finished_ids)
        self.num_steps += 1
        self.num_rows += len(msg.seq_ids)
        self.num_updates += len(msg.block_table_updates)
        self.num_forks += len(msg.forks)
        return result


def _workload(vocab: int):
    rng = random.Random(3)
    shared = [rng.randrange(4, vocab) for _ in range(40)]
    prompts = [
        [rng.randrange(4, vocab) for _ in range(7)],
        shared + [rng.randrange(4, vocab) for _ in range(25)],
        [rng.randrange(4, vocab) for _ in range(90)],
        shared + [rng.randrange(4, vocab) for _ in range(30)],
        shared + [rng.randrange(4, vocab) for _ in range(12)],
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, presence_penalty=0.6, repetition_penalty=1.3, max_tokens=28,
                       ignore_eos=True),
        SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=10),
        SamplingParams(n=2, best_of=3, temperature=1.0, seed=2, frequency_penalty=0.5, max_tokens=20,
                       ignore_eos=True),
    ]
    return prompts, params


@pytest.mark.parametrize("mode,budget,caching", [("swap", 32, True), ("recompute", 24, False), ("recompute", 512, True)])
def test_the_workers_state_mirrors_the_scheduler_and_empties(tiny_paths, mode, budget, caching):
    kwargs = dict(
        model=tiny_paths["llama"], max_model_len=256, max_num_batched_tokens=budget, max_num_seqs=12,
        preemption_mode=mode, enable_prefix_caching=caching, swap_space_gb=0.05,
    )
    reference = LLM(**kwargs, kv_cache_memory_gb=0.05)  # roomy: never preempts
    llm = LLM(**kwargs, num_gpu_blocks_override=22)  # tight: preempts
    check = MirrorCheck(llm)
    prompts, params = _workload(llm.engine.model_config.vocab_size)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    expected = reference.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    counters = llm.engine.scheduler.counters
    assert counters.preemptions_swap + counters.preemptions_recompute > 0
    assert check.num_forks > 0 and check.num_updates > 0
    # updates are rare next to rows: a table goes to the workers once, then only its changes
    assert check.num_updates < check.num_rows / 4
    assert (check.batch.num_requests, check.batch.num_seqs) == (0, 0)
    usage = llm.engine.block_manager.usage()
    assert usage.gpu_used == 0 and usage.cpu_used == 0


def test_an_aborted_last_request_leaves_no_state(tiny_paths):
    llm = LLM(model=tiny_paths["opt"], max_model_len=128, kv_cache_memory_gb=0.01)
    engine = llm.engine
    batch = engine.executor.worker.runner.batch
    engine.add_request("a", None, SamplingParams(n=2, temperature=1.0, max_tokens=50), prompt_token_ids=[5, 6, 7])
    for _ in range(3):
        engine.step()
    assert (batch.num_requests, batch.num_seqs) == (1, 2)
    assert engine.abort_request("a")
    assert (batch.num_requests, batch.num_seqs) == (0, 0)
