"""LoRA adapters in the engine: greedy tokens equal HF + PeftModel's, token for token
(float32), alone, in mixed batches, under preemption; adapters never share KV blocks; slots
are loaded and evicted as counted."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayserve_paged import LLM, LoRARequest, SamplingParams
from rayserve_paged.engine.llm_engine import RequestError
from rayserve_paged.models.lora import LoRAError
from rayserve_paged.models.tiny import make_tiny_model
from tests.peft_adapters import greedy, peft_model, write_adapter, write_adapters

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Hello",
    "A much longer prompt that runs across more than one block of sixteen tokens, so the tables differ",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tiny_paths, tmp_path_factory):
    """{arch: {name: dir}}: three random adapters per family (ranks 8, 4, 16; rsLoRA on one)."""
    root = tmp_path_factory.mktemp("lora")
    return {arch: write_adapters(tiny_paths[arch], root / arch, arch) for arch in ("opt", "llama")}


@pytest.fixture(scope="module")
def expected(tiny_paths, adapters):
    """{(arch, adapter name or None): [greedy tokens per prompt]} from HF (+ PeftModel)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = {}
    for arch in ("opt", "llama"):
        tokenizer = AutoTokenizer.from_pretrained(tiny_paths[arch])
        ids = [tokenizer(p).input_ids for p in PROMPTS]
        models = {None: AutoModelForCausalLM.from_pretrained(tiny_paths[arch]).eval()}
        models.update({name: peft_model(tiny_paths[arch], path) for name, path in adapters[arch].items()})
        for name, model in models.items():
            cache[arch, name] = [greedy(model, p, MAX_TOKENS) for p in ids]
    return cache


def _llm(path, **options):
    options.setdefault("max_model_len", 256)
    options.setdefault("swap_space_gb", 0.01)
    options.setdefault("kv_cache_memory_gb", 0.05)
    options.setdefault("max_lora_rank", 16)
    return LLM(model=path, enable_lora=True, **options)


def _greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _requests(adapters_of_arch):
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(adapters_of_arch.items()))}


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_each_adapter_alone_equals_peft(tiny_paths, adapters, expected, arch):
    llm = _llm(tiny_paths[arch])
    for name, lora in _requests(adapters[arch]).items():
        assert _tokens(llm.generate(PROMPTS, _greedy(), lora_request=lora, use_tqdm=False)) == expected[arch, name]
    assert _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False)) == expected[arch, None]
    # the adapters change the output: the parity above is not the base model's
    assert all(expected[arch, name] != expected[arch, None] for name in adapters[arch])


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_mixed_batch_equals_each_alone(tiny_paths, adapters, expected, arch):
    llm = _llm(tiny_paths[arch], max_loras=3)
    loras = _requests(adapters[arch])
    names = [None, "a0", "a1", "a2"]
    prompts = [p for p in PROMPTS for _ in names]  # every prompt on the base and each adapter, interleaved
    per_prompt = [None if n is None else loras[n] for _ in PROMPTS for n in names]
    got = _tokens(llm.generate(prompts, _greedy(), lora_request=per_prompt, use_tqdm=False))
    want = [expected[arch, n][i] for i in range(len(PROMPTS)) for n in names]
    assert got == want
    assert llm.engine.lora_slots.counters.num_loads == 3 and llm.engine.lora_slots.counters.num_evictions == 0
    assert llm.engine.num_lora_requests == {"a0": 3, "a1": 3, "a2": 3}


@pytest.mark.parametrize("arch", ["opt", "llama"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mixed_batch_under_preemption(tiny_paths, adapters, expected, arch, mode):
    # 10 blocks of 8 tokens for 6 requests that grow to 13-37 tokens each: must preempt
    llm = _llm(
        tiny_paths[arch], max_loras=3, block_size=8, num_gpu_blocks_override=10, max_model_len=64,
        preemption_mode=mode, swap_space_gb=0.05, enable_prefix_caching=False,
    )  # fmt: skip
    loras = _requests(adapters[arch])
    names = ["a0", None, "a1", "a2", "a0", "a1"]
    prompts = [PROMPTS[i % 2] for i in range(len(names))]
    got = _tokens(llm.generate(
        prompts, _greedy(), lora_request=[None if n is None else loras[n] for n in names], use_tqdm=False
    ))  # fmt: skip
    counters = llm.engine.scheduler.counters
    if mode == "swap":
        assert counters.preemptions_swap > 0
    else:
        assert counters.preemptions_recompute > 0 and counters.preemptions_swap == 0
    assert got == [expected[arch, n][i % 2] for i, n in enumerate(names)]
    usage = llm.engine.block_manager.usage()
    assert usage.gpu_used == 0 and usage.cpu_used == 0
    assert llm.engine.lora_slots.num_pinned == 0


def test_prefix_cache_is_per_adapter(tiny_paths, adapters, expected):
    llm = _llm(tiny_paths["llama"], max_loras=2, block_size=16)
    loras = _requests(adapters["llama"])
    prompt = PROMPTS[2]
    num_full = (len(llm.get_tokenizer()(prompt).input_ids) - 1) // 16 * 16  # its full blocks, last token left out
    assert num_full >= 32
    counters = llm.engine.block_manager.counters

    def run(lora):
        before = counters.prefix_cache_hits
        out = llm.generate([prompt], _greedy(), lora_request=lora, use_tqdm=False)[0]
        return out, counters.prefix_cache_hits - before

    first, hits = run(loras["a0"])
    assert hits == 0 and first.num_cached_tokens == 0
    other, hits = run(loras["a1"])  # same prompt, another adapter: nothing shared
    assert hits == 0 and other.num_cached_tokens == 0
    base, hits = run(None)  # nor with the base model
    assert hits == 0 and base.num_cached_tokens == 0
    again, hits = run(loras["a0"])  # the first adapter again: its own blocks
    assert hits == num_full and again.num_cached_tokens == num_full
    assert [first.outputs[0].token_ids, other.outputs[0].token_ids, base.outputs[0].token_ids] == [
        expected["llama", "a0"][2], expected["llama", "a1"][2], expected["llama", None][2]
    ]
    assert again.outputs[0].token_ids == expected["llama", "a0"][2]


def test_four_adapters_in_two_slots(tiny_paths, adapters, expected, tmp_path):
    """max_loras=2, four adapters in flight at once: the first two run, the others wait for a
    slot and each takes the least recently released one."""
    arch = "llama"
    paths = dict(adapters[arch])
    paths["a3"] = str(write_adapter(tiny_paths[arch], tmp_path / "a3", arch, "attn", 8, 8, seed=99))
    llm = _llm(tiny_paths[arch], max_loras=2)
    loras = _requests(paths)
    names = ["a0", "a1", "a2", "a3"]
    outputs = llm.generate([PROMPTS[0]] * 4, _greedy(), lora_request=[loras[n] for n in names], use_tqdm=False)
    assert all(o.finished for o in outputs)
    assert _tokens(outputs[:3]) == [expected[arch, n][0] for n in names[:3]]
    slots = llm.engine.lora_slots
    assert (slots.counters.num_loads, slots.counters.num_evictions) == (4, 2)
    # a0 and a1 finish in one step; a2 takes a0's slot, a3 takes a1's
    assert _slot_ids(slots) == {3: 0, 4: 1}
    pool = llm.engine.executor.worker.runner.lora
    assert (pool.counters.num_added, pool.counters.num_activations) == (4, 4)  # each read once, at registration
    # a3 alone gives the same tokens as in the crowd
    alone = llm.generate([PROMPTS[0]], _greedy(), lora_request=loras["a3"], use_tqdm=False)
    assert _tokens(alone) == _tokens(outputs[3:])
    assert (slots.counters.num_loads, slots.counters.num_evictions) == (4, 2)  # a3 was resident
    # a0 again: it takes a2's slot (released before a3's), from CPU memory (no file read)
    again = llm.generate([PROMPTS[0]], _greedy(), lora_request=loras["a0"], use_tqdm=False)
    assert _tokens(again) == [expected[arch, "a0"][0]]
    assert (slots.counters.num_loads, slots.counters.num_evictions) == (5, 3) and _slot_ids(slots) == {1: 0, 4: 1}
    assert (pool.counters.num_added, pool.counters.num_activations) == (4, 5)


def _slot_ids(slots) -> dict[int, int]:
    return {key[0]: slot for key, slot in slots.slot_of.items()}


def test_the_cpu_cache_refills_evicted_slots(tiny_paths, adapters):
    arch = "llama"
    llm = _llm(tiny_paths[arch], max_loras=1, max_cpu_loras=3)
    loras = _requests(adapters[arch])
    for name in ["a0", "a1", "a2", "a0", "a1"]:  # one slot: every switch is a slot load
        llm.generate([PROMPTS[1]], _greedy(), lora_request=loras[name], use_tqdm=False)
    slots, pool = llm.engine.lora_slots, llm.engine.executor.worker.runner.lora
    assert (slots.counters.num_loads, slots.counters.num_evictions) == (5, 4)
    assert (pool.counters.num_added, pool.counters.num_activations) == (3, 5)


def test_lora_modules_register_at_start(tiny_paths, adapters, expected):
    llm = _llm(tiny_paths["opt"], lora_modules={"first": adapters["opt"]["a0"]})
    lora = llm.engine.loras["first"]
    assert (lora.lora_int_id, lora.lora_path) == (1, adapters["opt"]["a0"])
    assert _tokens(llm.generate(PROMPTS, _greedy(), lora_request=lora, use_tqdm=False)) == expected["opt", "a0"]


def test_bad_adapters_are_refused_with_the_reason(tiny_paths, adapters, tmp_path):
    llm = _llm(tiny_paths["llama"], max_lora_rank=8)
    engine = llm.engine
    with pytest.raises(LoRAError, match=r"rank r=16 exceeds max_lora_rank 8"):
        engine.add_lora(LoRARequest("big", 5, adapters["llama"]["a2"]))
    head = write_adapter(tiny_paths["llama"], tmp_path / "head", "llama", ["q_proj", "lm_head"], 4, 8, seed=1)
    with pytest.raises(LoRAError, match=r"target module 'lm_head' is unknown"):
        engine.add_lora(LoRARequest("head", 6, str(head)))
    other = make_tiny_model("llama", tmp_path / "narrow", intermediate_size=96)  # MLP 96 wide, not 128
    narrow = write_adapter(other, tmp_path / "narrow-lora", "llama", "mlp", 4, 8, seed=2)
    with pytest.raises(LoRAError, match=r"module 'model.layers.0.mlp.(gate|up|down)_proj': shape mismatch"):
        engine.add_lora(LoRARequest("narrow", 7, str(narrow)))
    with pytest.raises(LoRAError, match=r"target module 'model.decoder.layers.0.self_attn.[qv]_proj' is unknown"):
        engine.add_lora(LoRARequest("opt", 9, adapters["opt"]["a1"]))  # an OPT adapter on a Llama
    with pytest.raises(LoRAError, match=r"no adapter_config.json"):
        engine.add_lora(LoRARequest("missing", 8, str(tmp_path / "nowhere")))
    assert engine.loras == {}
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, "/x")
    # no lora_modules_root: a runtime load by path is refused before the path is looked at
    with pytest.raises(LoRAError, match="runtime loading by path is off"):
        engine.load_lora("a0", adapters["llama"]["a0"])
    # an id is bound to one adapter for the engine's life: another adapter cannot take it
    engine.add_lora(LoRARequest("first", 3, adapters["llama"]["a0"]))
    engine.remove_lora("first")
    with pytest.raises(RequestError, match="lora_int_id: 3 was given to another adapter"):
        engine.add_lora(LoRARequest("second", 3, adapters["llama"]["a1"]))
    assert engine.add_lora(LoRARequest("first", 3, adapters["llama"]["a0"])).lora_int_id == 3  # the same one again
    with pytest.raises(RequestError, match="lora_int_id: 3 is the LoRA adapter 'first'"):
        engine.add_lora(LoRARequest("alias", 3, adapters["llama"]["a0"]))  # one adapter, one name
    assert sorted(engine.loras) == ["first"]


# --------------------------------------------------------------------------- the adapter lifecycle


class _Lifecycle:
    """A random run of loads, unloads, reloads of names with other weights, requests on random
    adapters and the base model, aborts and steps, against a model of what must hold."""

    NAMES = ("n0", "n1", "n2")

    def __init__(self, engine, dirs: dict[str, str], expected: dict, prompts: list[list[int]], rng, max_cpu: int):
        self.engine, self.dirs, self.expected, self.prompts, self.rng = engine, dirs, expected, prompts, rng
        self.max_cpu = max_cpu
        self.registered = {"n0": ("a0", 0)}  # name -> (adapter directory's name, incarnation)
        self.num_incarnations = 1
        self.started: set[int] = set()  # incarnations a request was added on
        self.live: dict[str, dict] = {}  # request id -> what it must produce
        self.num_requests = 0

    def retiring(self) -> set[int]:
        held = {inc for _, inc in self.registered.values()}
        return {r["inc"] for r in self.live.values() if r["inc"] is not None and r["inc"] not in held}

    def load(self, name: str | None = None, directory: str | None = None) -> None:
        name = name or self.rng.choice(self.NAMES)
        directory = directory or self.rng.choice(sorted(self.dirs))
        full = len(self.registered) + len(self.retiring()) >= self.max_cpu
        if name in self.registered or full:
            with pytest.raises(RequestError, match="already loaded" if name in self.registered else "max_cpu_loras"):
                self.engine.load_lora(name, self.dirs[directory])
            return
        self.engine.load_lora(name, self.dirs[directory])
        self.registered[name] = (directory, self.num_incarnations)
        self.num_incarnations += 1

    def unload(self, name: str | None = None) -> None:
        names = sorted(self.registered) if self.registered and self.rng.random() < 0.8 else self.NAMES
        name = name or self.rng.choice(names)
        assert self.engine.remove_lora(name) is (self.registered.pop(name, None) is not None)

    def request(self, name: str | None = None) -> None:
        name = name or self.rng.choice([None, *sorted(self.registered)])
        directory, inc = self.registered[name] if name is not None else (None, None)
        prompt = self.rng.randrange(len(self.prompts))
        rid = f"r{self.num_requests}"
        self.num_requests += 1
        self.engine.add_request(rid, None, _greedy(), prompt_token_ids=self.prompts[prompt], lora_request=name)
        first = inc is not None and inc not in self.started
        self.started.add(inc)
        want = self.expected["llama", directory][prompt]
        self.live[rid] = {"inc": inc, "want": want, "tokens": [], "first": first, "reported": False}

    def abort(self) -> None:
        if self.live:
            rid = self.rng.choice(sorted(self.live))
            assert self.engine.abort_request(rid)
            del self.live[rid]

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def step(self) -> None:
        for out in self.engine.step():
            record = self.live[out.request_id]
            assert out.error is None, out.error
            if not record["reported"]:
                record["reported"] = True
                if record["first"]:  # an adapter's first request finds no block cached under another
                    assert out.num_cached_tokens == 0, out.request_id
            for delta in out.outputs:
                record["tokens"] += delta.token_ids
            assert record["tokens"] == record["want"][: len(record["tokens"])], out.request_id
            if out.finished:
                assert record["tokens"] == record["want"], (out.request_id, out.outputs[-1].finish_reason)
                del self.live[out.request_id]

    def run(self, num_ops: int) -> None:
        # the start-up adapter serves, is unloaded, and a runtime load follows at once (the
        # sequence that reused its id), then anything goes
        self.request("n0")
        self.drain()
        self.unload("n0")
        self.load("n1", "a1")
        self.request("n1")
        ops = [(self.load, 2.5), (self.unload, 2), (self.request, 4), (self.abort, 0.7), (self.step, 3)]
        for _ in range(num_ops):
            op = self.rng.choices([o for o, _ in ops], [w for _, w in ops])[0]
            op()
            if self.rng.random() < 0.6:
                self.step()
        self.drain()
        assert not self.live
        engine = self.engine
        assert sorted(engine.loras) == sorted(self.registered)
        assert len(engine._lora_bytes) == len(self.registered)  # unloaded adapters retired: memory freed
        assert engine.lora_slots.num_pinned == 0
        assert engine.block_manager.usage().gpu_used == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adapter_lifecycle_equals_peft(tiny_paths, adapters, expected, seed):
    """Seeded random lifecycles: after every step each request's tokens so far equal HF +
    PEFT's for the adapter its name held when it was added; one or two slots, a CPU bound
    from one adapter, prefix caching on, swap or recompute preemption, aborts."""
    import random

    rng = random.Random(seed)
    dirs = adapters["llama"]
    max_loras = rng.choice([1, 2])
    max_cpu = rng.choice([max_loras, max_loras + 1])
    llm = _llm(
        tiny_paths["llama"], max_loras=max_loras, max_cpu_loras=max_cpu, lora_modules={"n0": dirs["a0"]},
        lora_modules_root=[str(Path(dirs["a0"]).parent)], block_size=8, num_gpu_blocks_override=20,
        max_model_len=128, preemption_mode=("swap", "recompute", "swap")[seed], swap_space_gb=0.05,
    )  # fmt: skip
    prompts = [llm.get_tokenizer()(p).input_ids for p in PROMPTS]
    run = _Lifecycle(llm.engine, dirs, expected, prompts, rng, max_cpu)
    run.run(num_ops=60)
    counters = llm.engine.scheduler.counters
    assert run.num_incarnations > 2 and counters.preemptions_swap + counters.preemptions_recompute > 0


# --------------------------------------------------------------------------- read once, fail locally


def test_an_adapter_directory_changed_after_load_changes_nothing(tiny_paths, adapters, expected, tmp_path, monkeypatch):
    """The adapter is read once, at registration: its directory deleted, replaced by one of a
    rank above max_lora_rank, or relative to a working directory left since, its requests
    (and everyone else's) are still served, with the weights it was loaded with."""
    import shutil

    dirs = adapters["llama"]
    for name in ("gone", "replaced", "relative"):
        shutil.copytree(dirs["a0"], tmp_path / name)
    llm = _llm(tiny_paths["llama"], max_loras=1, max_lora_rank=8, max_cpu_loras=4)
    monkeypatch.chdir(tmp_path)
    loras = [LoRARequest("gone", 1, str(tmp_path / "gone")), LoRARequest("replaced", 2, str(tmp_path / "replaced")),
             LoRARequest("relative", 3, "relative"), LoRARequest("a1", 4, dirs["a1"])]  # fmt: skip
    for lora in loras:
        llm.engine.add_lora(lora)
    shutil.rmtree(tmp_path / "gone")
    shutil.rmtree(tmp_path / "replaced")
    shutil.copytree(dirs["a2"], tmp_path / "replaced")  # rank 16 > max_lora_rank 8
    monkeypatch.chdir(tiny_paths["llama"])
    # one slot: every adapter switch is a slot load, from CPU memory
    names = ["gone", None, "replaced", "a1", "relative"]
    got = _tokens(llm.generate([PROMPTS[0]] * 5, _greedy(), lora_request=[n and llm.engine.loras[n] for n in names],
                               use_tqdm=False))  # fmt: skip
    assert got == [expected["llama", d][0] for d in ("a0", None, "a0", "a1", "a0")]
    assert llm.engine.lora_slots.counters.num_loads == 4


def test_an_adapter_that_cannot_be_activated_fails_only_its_requests(tiny_paths, adapters, expected, monkeypatch):
    llm = _llm(tiny_paths["llama"], max_loras=2)
    engine = llm.engine
    a0, a1 = (engine.add_lora(LoRARequest(n, i, adapters["llama"][n])) for i, n in ((1, "a0"), (2, "a1")))
    pool = engine.executor.worker.runner.lora
    activate = pool.activate

    def broken(slot, key):
        if key == a1.key:
            raise RuntimeError("device copy failed")
        activate(slot, key)

    monkeypatch.setattr(pool, "activate", broken)
    prompt = llm.get_tokenizer()(PROMPTS[0]).input_ids
    for rid, lora in (("on-a0", "a0"), ("on-a1", "a1"), ("base", None), ("on-a1-too", "a1")):
        engine.add_request(rid, None, _greedy(), prompt_token_ids=prompt, lora_request=lora)
    tokens, errors = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(t for d in out.outputs for t in d.token_ids)
            if out.error is not None:
                errors[out.request_id] = out.error
    assert sorted(errors) == ["on-a1", "on-a1-too"] and tokens["on-a1"] == tokens["on-a1-too"] == []
    assert "model: the LoRA adapter 'a1' could not be activated (device copy failed)" in errors["on-a1"]
    assert tokens["on-a0"] == expected["llama", "a0"][0] and tokens["base"] == expected["llama", None][0]
    # a1 is unloaded and its slot rolled back: the replica goes on with everything else
    assert sorted(engine.loras) == ["a0"] and a1.key not in engine.lora_slots.slot_of and not pool.holds(a1.key)
    out = llm.generate([PROMPTS[0]], _greedy(), lora_request=a0, use_tqdm=False)
    assert _tokens(out) == [expected["llama", "a0"][0]]
