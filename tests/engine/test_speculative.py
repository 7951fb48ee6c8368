"""Speculative decoding (n-gram drafts): greedy output equals decoding without drafts token
for token, under swap, recompute, chunked prefill and prefix caching, with the block
manager's invariants after every step (no block leaked by a rejected draft) and the
workers' rows equal to the scheduler's; sampling keeps the distribution (chi-square);
stop strings cut where they would without drafts; what speculation refuses."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rayserve_paged import LLM, SamplingParams
from rayserve_paged.config import EngineConfig
from rayserve_paged.core.spec_decode import propose_ngram
from rayserve_paged.models import quant
from rayserve_paged.models.decoder import UNDECIDED
from rayserve_paged.models.loader import get_model_config, load_model
from rayserve_paged.models.sampler import Sampler
from rayserve_paged.models.sampler import SamplingBatch
from rayserve_paged.ops import cpu_layer, quant_cpu
from rayserve_paged.serve_llm import ENGINE_KWARGS, UNSUPPORTED_ENGINE_KWARGS
from rayserve_paged.worker.static_decode import DecodeRows, StaticDecode, verification_rows
from tests.engine.test_every_request_ends import BudgetCheck, _assert_idle
from tests.models.test_gguf import write_gguf

SPEC = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
            disable_by_batch_size=64)  # fmt: skip


def _repetitive_prompts(rng: random.Random, num: int, vocab: int = 500) -> list[list[int]]:
    """Prompts that repeat a random phrase (so lookups find matches), of random lengths."""
    prompts = []
    for _ in range(num):
        phrase = [rng.randrange(4, vocab) for _ in range(rng.randrange(2, 7))]
        prompt = phrase * rng.randrange(2, 6) + [rng.randrange(4, vocab) for _ in range(rng.randrange(0, 4))]
        prompts.append(prompt[: rng.randrange(3, len(prompt) + 1)])
    return prompts


def test_ngram_proposals_follow_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [7, 8]  # "1 2 3" last seen before 7 8
    assert propose_ngram(tokens, 5, 1, 3) == [7, 8, 1, 2, 3]
    assert propose_ngram([5, 6, 7], 3, 1, 3) == []
    assert propose_ngram([4, 5, 4], 3, 1, 3) == [5, 4]  # only n = 1 matches
    assert propose_ngram([4, 5, 4], 3, 2, 3) == []


WORLDS = {
    "roomy": dict(max_model_len=128, num_gpu_blocks_override=160, swap_space_gb=0),
    # a pool this small preempts: swap, then recompute; and chunked prefill in small chunks
    "swap": dict(block_size=8, max_model_len=96, max_num_seqs=6, max_num_batched_tokens=24, num_gpu_blocks_override=14,
                 watermark=0.0, swap_space_gb=0.002, preemption_mode="swap"),
    "recompute": dict(block_size=8, max_model_len=96, max_num_seqs=6, max_num_batched_tokens=24,
                      num_gpu_blocks_override=14, watermark=0.0, swap_space_gb=0, preemption_mode="recompute"),
}  # fmt: skip


def mixed_params(rng: random.Random, num: int, wide: SamplingParams) -> list[SamplingParams]:
    """Greedy rows of random lengths, one with logprobs (drafts verified with them), a wide
    one (`wide`: no drafts) and a penalised one (no drafts)."""
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 40), ignore_eos=True) for _ in range(num)]
    params[1] = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True)
    params[2] = wide
    params[3] = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3)
    return params


def generate_as_without_drafts(
    model: str, spec: dict, world: dict, prompts, params, **engine
) -> tuple[LLM, BudgetCheck]:
    """The engine with `spec` answers every request as the engine without it: the same tokens,
    finish reasons and logprobs. Returns the speculating LLM and its per-step budget check.
    `engine`: more options of both engines (a tokenizer)."""
    off = LLM(model=model, **engine, **world)
    on = LLM(model=model, speculative_config=spec, **engine, **world)
    check = BudgetCheck(on)
    expected = off.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    got = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for e, g in zip(expected, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in e.outputs]
    for e_choice, g_choice in zip(expected[1].outputs[0].logprobs, got[1].outputs[0].logprobs):
        assert g_choice.keys() == e_choice.keys()
        for token in e_choice:
            assert g_choice[token] == pytest.approx(e_choice[token], abs=1e-4)
    return on, check


@pytest.mark.parametrize("world", list(WORLDS))
def test_greedy_output_is_the_same_with_drafts(tiny_paths, world):
    _check_greedy_with_drafts(tiny_paths["llama"], world)


def _check_greedy_with_drafts(model: str, world: str, **engine) -> LLM:
    """generate_as_without_drafts on repetitive prompts (prefix-cache hits among them) in
    `world`: drafts accepted, preemptions where the world is small, nothing left behind.
    Returns the speculating LLM."""
    rng = random.Random(f"greedy-{world}")
    prompts = _repetitive_prompts(rng, 8)
    shared = prompts[0][:9]
    prompts += [shared + p for p in prompts[1:4]]  # prefix-cache hits
    params = mixed_params(rng, len(prompts), SamplingParams(n=2, best_of=3, temperature=0.8, seed=3, max_tokens=10))
    on, check = generate_as_without_drafts(model, SPEC, WORLDS[world], prompts, params, **engine)
    engine = on.engine
    assert engine.scheduler.counters.spec_decode_num_draft_tokens > 0
    assert engine.spec_decode_num_accepted_tokens > 0
    if world != "roomy":
        counters = engine.scheduler.counters
        assert counters.preemptions_swap + counters.preemptions_recompute > 0
    _assert_idle(on, check)
    return on


@pytest.mark.parametrize("world", ["swap", "recompute"])
def test_aborts_mid_draft_leave_nothing_and_the_others_answer_as_without_drafts(tiny_paths, world):
    """Requests aborted right after a step that verified drafts give back every block (the
    drafts' slots included); the requests left answer exactly as without speculation."""
    rng = random.Random(f"abort-{world}")
    prompts = _repetitive_prompts(rng, 6)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    off = LLM(model=tiny_paths["llama"], **WORLDS[world])
    on = LLM(model=tiny_paths["llama"], speculative_config=SPEC, **WORLDS[world])
    check = BudgetCheck(on)
    engine = on.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    aborted, tokens = set(), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(t for d in out.outputs for t in d.token_ids)
        if not aborted and engine.scheduler.counters.spec_decode_num_draft_tokens > 0:
            aborted = {f"r{i}" for i in range(0, len(prompts), 2)}  # drafts were verified: abort half
            for request_id in aborted:
                assert engine.abort_request(request_id)
    assert aborted, "no step drafted"
    kept = [i for i in range(len(prompts)) if f"r{i}" not in aborted]
    expected = off.generate(prompt_token_ids=[prompts[i] for i in kept], sampling_params=params, use_tqdm=False)
    assert [tokens[f"r{i}"] for i in kept] == [list(e.outputs[0].token_ids) for e in expected]
    _assert_idle(on, check)


def test_drafts_stop_at_the_batch_size_limit(tiny_paths):
    rng = random.Random(5)
    prompts = _repetitive_prompts(rng, 6)
    llm = LLM(model=tiny_paths["llama"], max_model_len=128, num_gpu_blocks_override=160,
              speculative_config={**SPEC, "disable_by_batch_size": 6})  # fmt: skip
    seen = []
    real = llm.engine.executor.execute

    def execute(msg):
        if msg.draft_seq_ids:
            seen.append(len(msg.seq_ids))
        return real(msg)

    llm.engine.executor.execute = execute
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 6 * i, ignore_eos=True) for i in range(6)]
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert seen and max(seen) < 6  # while 6 run, no step drafts; as they end, drafts come back


def test_stop_strings_inside_accepted_drafts_cut_where_they_would_without(tiny_paths):
    prompts = _repetitive_prompts(random.Random("greedy-roomy"), 8)
    off = LLM(model=tiny_paths["llama"], max_model_len=128, kv_cache_memory_gb=0.01)
    on = LLM(model=tiny_paths["llama"], max_model_len=128, kv_cache_memory_gb=0.01, speculative_config=SPEC)
    plain = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = off.generate(prompt_token_ids=prompts, sampling_params=plain, use_tqdm=False)
    for prompt, out in zip(prompts, full):
        text = out.outputs[0].text
        for at in (5, 12, 20):
            stop = text[at : at + 3]
            if len(stop) < 3:
                continue
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
            (e,) = off.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
            (g,) = on.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
            assert (g.outputs[0].text, g.outputs[0].finish_reason) == (e.outputs[0].text, e.outputs[0].finish_reason)
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
    assert on.engine.spec_decode_num_accepted_tokens > 0


# ---------------------------------------------------------------------------- the CPU decode path


@pytest.fixture
def compiled_gguf(tiny_paths, tmp_path, monkeypatch):
    """The tiny Llama as a Q8_0 GGUF whose decode steps take the compiled CPU decoder layer
    (models/compiled_decode.py): the compiled group-quantized kernels are chosen whatever
    the CPU (by default only with AVX-512, where they are the faster ones)."""
    if quant_cpu.load() is None or cpu_layer.load() is None:
        pytest.skip("the compiled CPU kernels need a C++ compiler")
    monkeypatch.setattr(quant, "cpu_kernel_plan", lambda: quant.COMPILED)
    path = tmp_path / "tiny.Q8_0.gguf"
    write_gguf(path, Path(tiny_paths["llama"]), "Q8_0")
    return str(path), tiny_paths["llama"]


def _layer_calls(monkeypatch) -> list[int]:
    """The compiled decoder layer's calls from now on: each call's row count."""
    calls: list[int] = []
    call = cpu_layer.DecoderLayerKernel.__call__

    def counted(self, layer, step, *args, **kwargs):
        calls.append(step.struct.num_tokens)
        return call(self, layer, step, *args, **kwargs)

    monkeypatch.setattr(cpu_layer.DecoderLayerKernel, "__call__", counted)
    return calls


@pytest.mark.parametrize("world", list(WORLDS))
def test_verification_steps_take_the_compiled_cpu_decode_path(compiled_gguf, world, monkeypatch):
    """On the compiled decoder layer, greedy with drafts equals greedy without (swap and
    recompute included), and every decode-only step that verifies drafts runs there, its
    rows expanded to one-token rows (worker/static_decode.py expanded_draft_rows), not on
    the eager prefill-with-context path."""
    calls = _layer_calls(monkeypatch)
    verified = []  # per decode-only verification step: (rows, path, layer calls' row counts)
    llm_init = LLM.__init__

    def init(self, *args, **kwargs):
        llm_init(self, *args, **kwargs)
        if kwargs.get("speculative_config") is None:
            return
        runner = self.engine.executor.worker.runner
        execute = runner.execute

        def traced(msg, kv_caches):
            calls.clear()
            out = execute(msg, kv_caches)
            if msg.draft_seq_ids and len(msg.token_ids) == len(msg.seq_ids) + sum(msg.num_draft_tokens):
                verified.append((len(msg.token_ids), runner.last_path, list(calls)))
            return out

        runner.execute = traced

    monkeypatch.setattr(LLM, "__init__", init)
    model, tokenizer = compiled_gguf
    on = _check_greedy_with_drafts(model, world, tokenizer=tokenizer)
    num_layers = on.engine.model_config.num_layers
    static = on.engine.executor.worker.runner.static_decode
    config = on.engine.config
    # the buckets hold every expanded step: up to disable_by_batch_size - 1 sequences of 1 + k rows, in the budget
    needed = verification_rows(config.max_num_seqs, on.engine.scheduler.config.max_num_batched_tokens,
                               SPEC["num_speculative_tokens"], SPEC["disable_by_batch_size"])  # fmt: skip
    assert static.buckets[-1] >= needed and (world == "roomy" or needed > config.max_num_seqs)
    assert verified and any(rows > 1 for rows, _, _ in verified)
    for rows, path, layer_calls in verified:
        assert (path, layer_calls) == ("static-eager", [static.bucket(rows)] * num_layers)


def test_expanded_rows_equal_the_prefill_with_context_row(compiled_gguf, monkeypatch):
    """A row of 1 + k query tokens over a cached context, computed as 1 + k one-token
    decode rows on the compiled layer (and layer by layer), gives the logits of the eager
    prefill-with-context row: row j must see the keys and values rows < j write in the same
    layer (the caches are NaN-filled, so a read of an unwritten slot shows)."""
    from tests.models.paged import PagedRunner

    config = get_model_config(compiled_gguf[0])
    model = load_model(compiled_gguf[0], dtype=torch.float32)
    backend = model.model.layers[0].self_attn.attn.backend
    prompt, query = [1, 40, 41, 42, 43, 44, 45], [46, 47, 48, 49, 50]  # the last token, then 4 drafts
    reference = PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_dim)
    reference.step([(0, prompt)])
    want = reference.step([(0, query)], all_logits=True)  # [5, vocab]: prefill with context
    calls = _layer_calls(monkeypatch)
    for compiled in (True, False):
        model.model.use_compiled_decode, model.model._compiled = compiled, UNDECIDED
        runner = PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_dim)
        runner.step([(0, prompt)])
        start = len(prompt)
        table = runner.block_tables[0]
        rows = DecodeRows(
            token_ids=query, positions=list(range(start, start + len(query))),
            seq_lens=list(range(start + 1, start + len(query) + 1)), block_tables=[table] * len(query),
            slot_mapping=runner._slots(0, start, len(query)), sampled=list(range(len(query))),
        )  # fmt: skip
        static = StaticDecode(model, runner.block_size, 1, 64, "cpu", backend, max_num_rows=len(query))
        calls.clear()
        with torch.no_grad():
            got = model.compute_logits(static.forward(rows, runner.kv_caches))  # [5, vocab]
        assert calls == ([static.bucket(len(query))] * config.num_layers if compiled else [])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))


# ---------------------------------------------------------------------------- sampling


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def _verify_batch(num: int, temperature: float, seed: int | None) -> SamplingBatch:
    rows = 2 * num  # one draft each: 2 positions
    return SamplingBatch(
        list(range(rows)), [temperature] * rows, [-1] * rows, [1.0] * rows, [0.0] * rows,
        [None if seed is None else seed + i // 2 for i in range(rows)], [0] * rows, [i % 2 for i in range(rows)],
        [1] * rows, [0] * rows, [None] * rows,
    )  # fmt: skip


def test_verification_keeps_the_distribution_and_a_wrong_residual_fails():
    """One draft on a 6-token distribution, 6000 times (fixed seeds): the first output
    token is distributed as p. A rule that redraws from p instead of the residual gives
    p(d) + (1 - p(d)) p(d) for the draft: the same counts are far from that."""
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, 0.0, -1.0])
    p = logits.softmax(-1).tolist()
    num = 6000
    draft = 0  # the most likely token: accepted often, rejected often enough
    batch = _verify_batch(num, 1.0, seed=1000)
    samples = Sampler().verify(logits.repeat(2 * num, 1), batch, [[draft]] * num)
    counts = [0] * len(p)
    for sample in samples:
        counts[sample.token_ids[0]] += 1
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001
    assert _chi_square(counts, p) < 20.5, counts
    wrong = [pi * (1 - p[draft]) for pi in p]
    wrong[draft] += p[draft]
    assert _chi_square(counts, wrong) > 100, counts
    # seeded: the same draws again
    again = Sampler().verify(logits.repeat(2 * num, 1), batch, [[draft]] * num)
    assert [s.token_ids for s in again] == [s.token_ids for s in samples]


def test_sampled_tokens_have_the_same_frequencies_with_drafts(tiny_paths):
    """The tiny model at temperature 1 with top_k 3: output tokens 1..3 by position, seeds
    0..N-1, have the same frequencies with drafts as without (two-sample chi-square). The
    prompt holds every token once, shuffled, so each step has a draft to verify (mostly
    rejected: the residual draws are what is tested)."""
    vocab = LLM(model=tiny_paths["llama"], max_model_len=8, num_gpu_blocks_override=4).engine.model_config.vocab_size
    prompt = list(range(4, vocab))
    random.Random(0).shuffle(prompt)
    num = 300
    counts = {}
    for name, spec in (("off", None), ("on", SPEC)):
        llm = LLM(model=tiny_paths["llama"], max_model_len=vocab + 8, num_gpu_blocks_override=200, swap_space_gb=0,
                  max_num_seqs=64, speculative_config=spec)  # fmt: skip
        params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, seed=s, ignore_eos=True) for s in range(num)]
        outs = []
        for i in range(0, num, 30):  # 30 at a time: under disable_by_batch_size 64
            outs += llm.generate(prompt_token_ids=[prompt] * 30, sampling_params=params[i : i + 30], use_tqdm=False)
        counts[name] = [dict() for _ in range(4)]
        for out in outs:
            for pos, token in enumerate(out.outputs[0].token_ids):
                counts[name][pos][token] = counts[name][pos].get(token, 0) + 1
        if spec is not None:
            assert llm.engine.scheduler.counters.spec_decode_num_draft_tokens >= num  # drafts were verified
    for pos in range(1, 4):  # position 0 comes from the prefill step (no drafts)
        a, b = counts["off"][pos], counts["on"][pos]
        tokens = sorted(set(a) | set(b))
        stat = sum((a.get(t, 0) - b.get(t, 0)) ** 2 / (a.get(t, 0) + b.get(t, 0)) for t in tokens)
        # df = len(tokens) - 1; P(chi2_df > 3 df + 12) < 0.001 for the df here
        assert stat < 3 * (len(tokens) - 1) + 12, (pos, a, b)


def assert_seeded_requests_repeat(model: str, spec: dict) -> LLM:
    """A seeded request gets the same tokens alone and beside another request."""
    llm = LLM(model=model, max_model_len=64, kv_cache_memory_gb=0.01, speculative_config=spec)
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=42, ignore_eos=True)
    prompt = [11, 12, 13, 14] * 3
    (a,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    (b,) = llm.generate(prompt_token_ids=[prompt, [5, 6, 11, 12, 13]], sampling_params=params, use_tqdm=False)[:1]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    return llm


def test_seeded_requests_repeat_with_drafts(tiny_paths):
    assert_seeded_requests_repeat(tiny_paths["llama"], SPEC)


# ---------------------------------------------------------------------------- configuration


def test_speculative_config_is_checked_and_reaches_the_engine_from_serve_args():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative_config.num_speculative_tokens == 2
    assert EngineConfig(speculative_config={"method": "draft_model", "model": "x"}).speculative_config.model == "x"
    with pytest.raises(ValidationError, match="eagle3"):
        EngineConfig(speculative_config={"method": "eagle3", "model": "x"})
    with pytest.raises(ValidationError, match="prompt_lookup_min"):
        EngineConfig(speculative_config={"prompt_lookup_min": 5, "prompt_lookup_max": 2})
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    assert ENGINE_KWARGS["speculative_config"].field == "speculative_config"
    assert "speculative_config" not in UNSUPPORTED_ENGINE_KWARGS


def test_beam_search_runs_without_drafts(tiny_paths):
    on = LLM(model=tiny_paths["llama"], max_model_len=64, kv_cache_memory_gb=0.01, speculative_config=SPEC)
    off = LLM(model=tiny_paths["llama"], max_model_len=64, kv_cache_memory_gb=0.01)
    params = SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=8)
    prompt = [[3, 4, 5, 3, 4, 5, 3, 4]]
    e = off.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    g = on.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    assert [c.token_ids for c in g[0].outputs] == [c.token_ids for c in e[0].outputs]
    assert on.engine.scheduler.counters.spec_decode_num_draft_tokens == 0


# ---------------------------------------------------------------------------- metrics


def test_acceptance_per_position_adds_up_and_is_exported(tiny_paths):
    from prometheus_client.parser import text_string_to_metric_families

    from rayserve_paged.telemetry import ReplicaTelemetry, TelemetryConfig, names

    rng = random.Random("positions")
    llm = LLM(model=tiny_paths["llama"], max_model_len=128, num_gpu_blocks_override=160, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm.generate(prompt_token_ids=_repetitive_prompts(rng, 4), sampling_params=params, use_tqdm=False)
    engine = llm.engine
    drafts = engine.scheduler.counters.spec_decode_num_draft_tokens_per_position
    accepted = engine.spec_decode_num_accepted_tokens_per_position
    assert sum(drafts) == engine.scheduler.counters.spec_decode_num_draft_tokens > 0
    assert sum(accepted) == engine.spec_decode_num_accepted_tokens > 0
    assert len(drafts) == len(accepted) == SPEC["num_speculative_tokens"]  # every position, drafted or not
    # a row with a draft at j has one at every earlier position, and keeps j only if it kept j - 1
    assert drafts == sorted(drafts, reverse=True) and accepted == sorted(accepted, reverse=True)
    assert all(a <= d for a, d in zip(accepted, drafts))
    telemetry = ReplicaTelemetry(engine, TelemetryConfig(replica="spec"))
    try:
        text = telemetry.metrics_text()
    finally:
        telemetry.shutdown()
    got = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_per_position_total"):
                got.setdefault(s.name, {})[int(s.labels[names.POSITION])] = s.value
    assert got == {
        "rayserve_paged_spec_decode_num_draft_tokens_per_position_total": dict(enumerate(drafts)),
        "rayserve_paged_spec_decode_num_accepted_tokens_per_position_total": dict(enumerate(accepted)),
    }


def test_a_draft_record_pauses_after_a_low_window_and_doubles_while_it_stays_low():
    from rayserve_paged.core.spec_decode import MAX_PAUSE, PAUSE, WINDOW, DraftRecord

    def paused_steps(record: DraftRecord) -> int:
        n = 0
        while not record.drafts():
            n += 1
        return n

    record = DraftRecord()
    for _ in range(WINDOW - 1):
        assert record.drafts()
        record.verified(0, 1.0)
    assert record.drafts()  # a window is judged only once it is whole
    record.verified(0, 1.0)
    assert paused_steps(record) == PAUSE
    for expected in (2 * PAUSE, 4 * PAUSE, 8 * PAUSE, MAX_PAUSE, MAX_PAUSE):  # low windows in a row
        for _ in range(WINDOW):
            record.verified(1, 1.5)  # 1 kept per step, below 1.5
        assert paused_steps(record) == expected
    for accepted in (0, 1, 2, 1):  # 4 kept in 4 steps: at the floor, not below it
        record.verified(accepted, 1.0)
    assert record.drafts() and record.next_pause == PAUSE  # the doubling ends
    for _ in range(WINDOW):
        record.verified(0, 0.0)  # floor 0: never paused
    assert record.drafts()
