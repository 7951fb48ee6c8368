"""Every request ends, whatever its width: groups of n / best_of up to max_num_seqs under
chunked prefill, swap and recompute, beam search with stop strings, aborts and reused ids.

The randomized worlds check after every step what the scheduler promises (at most
max_num_seqs sequences and max_num_batched_tokens tokens, the block manager's invariants,
each worker row equal to the scheduler's) and at the end that every request finished and
that the pools and the workers' batches are empty."""

from __future__ import annotations

import random

import pytest

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.core.sequence import KV_CACHE_LIMIT
from rayserve_paged.engine.output_processor import OutputKind
from tests.core.invariants import check_block_manager
from tests.engine.test_persistent_batch import MirrorCheck


class BudgetCheck(MirrorCheck):
    """MirrorCheck, and after every step: the budgets held and the block manager is sound."""

    def __init__(self, llm: LLM) -> None:
        super().__init__(llm)
        self.config = llm.engine.scheduler.config
        self.max_rows = 0

    def execute(self, msg):
        assert len(msg.seq_ids) <= self.config.max_num_seqs, f"step {self.num_steps}: {len(msg.seq_ids)} rows"
        assert sum(msg.num_query_tokens) <= self.config.max_num_batched_tokens, f"step {self.num_steps}"
        self.max_rows = max(self.max_rows, len(msg.seq_ids))
        result = super().execute(msg)
        check_block_manager(self.engine.block_manager)
        return result


def _assert_idle(llm: LLM, check: MirrorCheck) -> None:
    usage = llm.engine.block_manager.usage()
    assert (usage.gpu_used, usage.cpu_used) == (0, 0)
    assert (check.batch.num_requests, check.batch.num_seqs) == (0, 0)
    assert not llm.engine.has_unfinished_requests()


# ---------------------------------------------------------------------------- the crash


ISSUE_WORLD = dict(
    block_size=8, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=12,
    watermark=0.0, swap_space_gb=0.01,
)  # fmt: skip


@pytest.mark.parametrize("width", [{"n": 4}, {"n": 1, "best_of": 4}], ids=["n4", "best_of4"])
def test_a_wide_request_beside_short_ones_under_chunked_prefill_ends(tiny_paths, width):
    """A = 40-token prompt with n=4 (or best_of=4), B, C, D = 8-token prompts: A's first
    chunk, then (before the fix) B, C, D beside A's last chunk, 7 sequences of 4 allowed,
    and `IndexError: no free blocks` on the next step. Now every request finishes."""
    llm = LLM(model=tiny_paths["llama"], **ISSUE_WORLD)
    roomy = LLM(model=tiny_paths["llama"], **(ISSUE_WORLD | {"num_gpu_blocks_override": 64}))
    check = BudgetCheck(llm)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(4, vocab) for _ in range(n)] for n in (40, 8, 8, 8)]
    params = [SamplingParams(**width, temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)] + [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ] * 3
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    expected = roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert all(out.finished for out in got)
    assert check.max_rows == 4
    # the short requests are exactly what they are with room to spare
    assert [o.outputs[0].token_ids for o in got[1:]] == [o.outputs[0].token_ids for o in expected[1:]]
    # A: 4 x 60 tokens do not fit 12 blocks of 8: its newest samples end at the pool's limit
    # (finish_reason "length", stop_reason kv_cache_limit), each a prefix of its roomy twin
    wide = got[0].outputs
    assert len(wide) == width["n"]
    if width["n"] == 4:
        for mine, twin in zip(wide, expected[0].outputs):
            assert mine.finish_reason == "length"
            assert mine.token_ids == twin.token_ids[: len(mine.token_ids)]
            assert len(mine.token_ids) == 20 or mine.stop_reason == KV_CACHE_LIMIT
        assert any(c.stop_reason == KV_CACHE_LIMIT for c in wide)
    _assert_idle(llm, check)


# ---------------------------------------------------------------------------- beam search + stop


def test_beam_search_ends_each_hypothesis_at_a_stop_string_as_greedy_does(tiny_paths):
    llm = LLM(model=tiny_paths["llama"], max_model_len=128)
    beam = dict(n=2, use_beam_search=True, temperature=0.0, max_tokens=30, ignore_eos=True)
    free = llm.generate(["hello there"], SamplingParams(**beam), use_tqdm=False)[0].outputs
    stop = free[0].text[8:11]  # a string the free search writes
    assert len(stop) == 3
    stopped = llm.generate(["hello there"], SamplingParams(**beam, stop=[stop]), use_tqdm=False)[0].outputs
    tokenizer = llm.get_tokenizer()
    assert len(stopped) == 2
    for choice in stopped:
        assert stop not in choice.text
        assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
        # the text is the hypothesis' tokens cut at the stop, which its last token completed
        whole = tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        assert whole.startswith(choice.text + stop)
        assert stop not in tokenizer.decode(choice.token_ids[:-1], skip_special_tokens=True)
    kept = llm.generate(
        ["hello there"], SamplingParams(**beam, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs
    assert [c.text for c in kept] == [c.text + stop for c in stopped]
    greedy = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False)
    assert greedy[0].outputs[0].finish_reason == "stop" and stop not in greedy[0].outputs[0].text


# ---------------------------------------------------------------------------- best_of + stop, in flight


def test_best_of_ranks_candidates_on_their_tokens_up_to_the_stop(tiny_paths):
    """Through the front end the engine keeps stepping while a stop string travels back
    (here: three steps late); the result equals the offline engine's, where the stop is
    applied before the next step: steps in flight after a stop count for nothing."""
    import asyncio

    from tests.deployments.engine_client import InProcessCore

    from rayserve_paged.engine.frontend import EngineFrontend

    prompt = "the quick brown"
    llm = LLM(model=tiny_paths["llama"], max_model_len=128, seed=3)
    free = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs  # fmt: skip
    stop = free[1].text[4:6]
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, stop=[stop])
    expected = llm.generate([prompt], params, use_tqdm=False)[0]
    assert any(c.finish_reason == "stop" for c in expected.outputs)

    class LateStops(InProcessCore):
        async def stop_sequences(self, request_id, stops):
            steps = self.engine.scheduler.counters  # noqa: F841 (the engine goes on meanwhile)
            for _ in range(3):
                await asyncio.sleep(0.02)
            await super().stop_sequences(request_id, stops)

    async def served():
        other = LLM(model=tiny_paths["llama"], max_model_len=128, seed=3)
        frontend = EngineFrontend(LateStops(other.engine), other.engine.tokenizer)
        ids = other.engine.encode(prompt)
        try:
            return await asyncio.wait_for(frontend.generate(ids, params, "b", prompt), 60)
        finally:
            await frontend.close()
            await frontend.core.close()

    got = asyncio.run(served())
    summary = lambda out: [(c.text, c.token_ids, c.finish_reason, round(c.cumulative_logprob, 5)) for c in out.outputs]  # noqa: E731
    assert summary(got) == summary(expected)


# ---------------------------------------------------------------------------- random worlds


def _random_params(rng: random.Random, max_num_seqs: int, stops: list[str]) -> SamplingParams:
    kind = rng.choice(["greedy", "sample", "n", "best_of", "beam", "penalties"])
    max_tokens = rng.randint(1, 24)
    common = dict(max_tokens=max_tokens, ignore_eos=rng.random() < 0.7)
    if rng.random() < 0.35:
        common["stop"] = [rng.choice(stops)]
    if kind == "greedy":
        return SamplingParams(temperature=0.0, **common)
    if kind == "beam":
        width = rng.randint(2, max_num_seqs) if max_num_seqs >= 2 else 2
        return SamplingParams(n=rng.randint(1, width), best_of=width, use_beam_search=True, temperature=0.0, **common)
    seed = rng.choice([None, rng.randrange(1000)])
    n = rng.randint(1, max_num_seqs) if kind == "n" else 1
    best_of = rng.randint(n, max_num_seqs) if kind == "best_of" else n
    extra = {}
    if kind == "penalties":
        extra = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    return SamplingParams(n=n, best_of=best_of, temperature=rng.choice([0.7, 1.0]), seed=seed, **extra, **common)


def _run_world(seed: int, model: str) -> dict:
    rng = random.Random(seed)
    block_size = rng.choice([8, 16])
    max_model_len = rng.choice([48, 64, 96])
    max_num_seqs = rng.randint(2, 8)
    chunking = rng.random() < 0.8
    budget = max(max_num_seqs, rng.choice([block_size, 2 * block_size, 64, 256]))
    if not chunking:
        budget = max(budget, max_model_len)
    one_len = -(-max_model_len // block_size)
    llm = LLM(
        model=model, block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, enable_chunked_prefill=chunking,
        num_gpu_blocks_override=rng.randint(one_len, 3 * one_len), watermark=0.0,
        swap_space_gb=rng.choice([0.0, 0.001, 0.01]), preemption_mode=rng.choice(["swap", "recompute", "auto"]),
        enable_prefix_caching=rng.random() < 0.5, seed=seed,
    )  # fmt: skip
    engine, processor = llm.engine, llm.processor
    check = BudgetCheck(llm)
    vocab = engine.model_config.vocab_size
    stops = ["e", "a ", "th", "o", "\n"]
    shared = [rng.randrange(4, vocab) for _ in range(2 * block_size)]
    live: set[str] = set()
    ended: list[str] = []  # ids whose request ended (finished or aborted): free for reuse
    outcome = {"finished": 0, "aborted": 0, "reused": 0, "stopped": 0}
    counter = 0

    def add() -> None:
        nonlocal counter
        if ended and rng.random() < 0.3:
            request_id = ended.pop(rng.randrange(len(ended)))
            outcome["reused"] += 1
        else:
            request_id, counter = f"w{seed}-{counter}", counter + 1
        length = rng.randint(1, max_model_len - 2)
        prompt = [rng.randrange(4, vocab) for _ in range(length)]
        if rng.random() < 0.3:
            prompt = (shared + prompt)[: max_model_len - 2]
        params = _random_params(rng, max_num_seqs, stops)
        engine.add_request(request_id, None, params, prompt_token_ids=prompt)
        processor.add_request(request_id, None, prompt, params, rng.choice([OutputKind.FINAL, OutputKind.DELTA]))
        live.add(request_id)

    for _ in range(rng.randint(3, 7)):
        add()
    steps = 0
    while engine.has_unfinished_requests() or live:
        steps += 1
        assert steps < 3000, f"world {seed}: still running {sorted(live)}"
        if rng.random() < 0.1 and counter < 14:
            add()
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            processor.abort_request(victim)
            live.discard(victim)
            ended.append(victim)
            outcome["aborted"] += 1
        for step_output in engine.step():
            output, stop = processor.process(step_output)
            if stop is not None:
                outcome["stopped"] += 1
                engine.stop_sequences(stop.request_id, stop.stops)
            if output is not None and output.finished:
                assert output.error is None, output.error
                live.discard(output.request_id)
                ended.append(output.request_id)
                outcome["finished"] += 1
        assert live <= set(engine.scheduler.groups) | {r for r in live if not processor.has_request(r)}
    assert not live
    _assert_idle(llm, check)
    outcome["steps"] = steps
    return outcome


def test_random_worlds_every_request_ends_within_the_budgets(tiny_paths):
    totals = {"finished": 0, "aborted": 0, "reused": 0, "stopped": 0, "steps": 0}
    for seed in range(14):
        for key, value in _run_world(seed, tiny_paths["llama"]).items():
            totals[key] += value
    # the worlds exercised what they are for
    assert totals["finished"] > 60 and totals["aborted"] > 3 and totals["reused"] > 3 and totals["stopped"] > 3
