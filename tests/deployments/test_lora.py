"""LoRA adapters over HTTP: the OpenAI `model` field picks the base model or an adapter
(through the official openai client), /v1/models lists adapters with their parent, and
vLLM's load / unload routes (off by default, behind the API key) change what is served."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from rayserve_paged import LLM, LoRARequest, SamplingParams
from rayserve_paged.config import EngineConfig
from rayserve_paged.deployments.openai_ingress import create_openai_app
from rayserve_paged.engine.llm_engine import LLMEngine
from tests.deployments.conftest import MAX_MODEL_LEN, MODEL, assert_openai_error, idle_client
from tests.peft_adapters import write_adapter

pytestmark = pytest.mark.anyio
KEY = "lora-test-key"
PROMPT = "Hello world"


@pytest.fixture(scope="module")
def adapters(tiny_opt_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("http-lora")
    return {
        "root": str(root),
        "a0": str(write_adapter(tiny_opt_path, root / "a0", "opt", "all", 8, 16, seed=1)),
        "a1": str(write_adapter(tiny_opt_path, root / "a1", "opt", "attn", 4, 8, seed=2)),
        "big": str(write_adapter(tiny_opt_path, root / "big", "opt", "attn", 32, 8, seed=3)),
    }


@pytest.fixture(scope="module")
def lora_engine(tiny_opt_path, adapters) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=tiny_opt_path, device="cpu", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64,
        swap_space_gb=0.01, max_loras=2, max_lora_rank=16, lora_modules={"a0": adapters["a0"]},
        lora_modules_root=[adapters["root"]],
    ))  # fmt: skip


LONG = [5 + (7 * i) % 300 for i in range(40)]  # token ids: two full blocks and some


@pytest.fixture(scope="module")
def offline_texts(tiny_opt_path, adapters) -> dict:
    """Greedy text of PROMPT on the base model and each adapter, from the offline LLM (and
    of the LONG token ids, under (name, "long"))."""
    llm = LLM(tiny_opt_path, max_model_len=MAX_MODEL_LEN, kv_cache_memory_gb=0.02, swap_space_gb=0.01,
              enable_lora=True, max_loras=2, max_lora_rank=16)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    texts = {None: llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text}
    for i, name in enumerate(("a0", "a1"), start=1):
        lora = LoRARequest(name, i, adapters[name])
        texts[name] = llm.generate(PROMPT, params, lora_request=lora, use_tqdm=False)[0].outputs[0].text
        long = {"prompt_token_ids": LONG}
        texts[name, "long"] = llm.generate(long, params, lora_request=lora, use_tqdm=False)[0].outputs[0].text
    assert len({texts[n] for n in (None, "a0", "a1")}) == 3  # every adapter changes the answer
    assert texts["a0", "long"] != texts["a1", "long"]
    return texts


@pytest.fixture
async def lora_client(lora_engine):
    async with idle_client(lora_engine) as client:
        yield client
    for name in list(lora_engine.loras):  # back to the start-up adapters
        if name != "a0":
            lora_engine.remove_lora(name)


def _http(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_model_field_selects_the_base_model_or_an_adapter(lora_client, lora_engine, adapters, offline_texts):
    app = create_openai_app(lora_client, lora_engine.tokenizer, MODEL)
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=_http(app)) as client:
        models = [m async for m in client.models.list()]
        assert [(m.id, m.parent, m.root) for m in models] == [(MODEL, None, None), ("a0", MODEL, adapters["a0"])]
        card = await client.models.retrieve("a0")
        assert (card.id, card.parent) == ("a0", MODEL)
        for name in (None, "a0"):
            completion = await client.completions.create(
                model=name or MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert completion.model == (name or MODEL)
            assert completion.choices[0].text == offline_texts[name]
        stream = await client.completions.create(
            model="a0", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [chunk async for chunk in stream]
        assert {c.model for c in chunks} == {"a0"}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == offline_texts["a0"]
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="a1", prompt=PROMPT, max_tokens=2)
        assert missing.value.body["code"] == "model_not_found" and "'a1' does not exist" in missing.value.body["message"]
        assert "the LoRA adapters 'a0'" in missing.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("a1")
    assert lora_engine.num_lora_requests["a0"] >= 2


async def test_runtime_routes_are_off_by_default(lora_client, lora_engine, adapters):
    async with _http(create_openai_app(lora_client, lora_engine.tokenizer, MODEL)) as http:
        response = await http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": adapters["a1"]})
        assert_openai_error(response, 404, None, "Not Found")
    assert "a1" not in lora_engine.loras


async def test_load_and_unload_at_run_time(lora_client, lora_engine, adapters, offline_texts, tmp_path):
    app = create_openai_app(lora_client, lora_engine.tokenizer, MODEL, KEY, allow_runtime_lora_updating=True)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "a1", "lora_path": adapters["a1"]}
    async with _http(app) as http:
        assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 401  # behind the key
        response = await http.post("/v1/load_lora_adapter", json=body, headers=auth)
        assert response.status_code == 200 and response.text == "Success: LoRA adapter 'a1' added successfully."
        again = await http.post("/v1/load_lora_adapter", json=body, headers=auth)
        assert_openai_error(again, 400, "lora_name", "'a1' has already been loaded")
        # bad directories: the reason, naming lora_path
        for path, reason in (
            (adapters["big"], "rank r=32 exceeds max_lora_rank 16"),
            (str(Path(adapters["root"]) / "nowhere"), "no adapter_config.json"),
            (str(tmp_path / "nowhere"), "must name a directory under lora_modules_root"),
        ):
            bad = await http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}, headers=auth)
            assert_openai_error(bad, 400, "lora_path", reason)
        for bad_body, param in (({"lora_name": "", "lora_path": "x"}, "lora_name"), ({"lora_name": "x"}, "lora_path"),
                                ({"lora_name": MODEL, "lora_path": adapters["a1"]}, "lora_name")):  # fmt: skip
            assert_openai_error(await http.post("/v1/load_lora_adapter", json=bad_body, headers=auth), 400, param)
        models = (await http.get("/v1/models", headers=auth)).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("a0", MODEL), ("a1", MODEL)]
        done = await http.post("/v1/completions", headers=auth, json={
            "model": "a1", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        })  # fmt: skip
        assert done.status_code == 200 and done.json()["choices"][0]["text"] == offline_texts["a1"]
        unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=auth)
        assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'a1' removed successfully."
        gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=auth)
        assert_openai_error(gone, 404, "lora_name", "'a1' cannot be found")
        after = await http.post("/v1/completions", headers=auth, json={"model": "a1", "prompt": PROMPT})
        assert_openai_error(after, 404, "model", "'a1' does not exist")
    assert sorted(lora_engine.loras) == ["a0"]


async def test_malformed_bodies_of_the_runtime_routes_are_4xx(lora_client, lora_engine, adapters):
    app = create_openai_app(lora_client, lora_engine.tokenizer, MODEL, KEY, allow_runtime_lora_updating=True)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bodies = ["", "not json", "[]", "null", '"a1"', '{"lora_name": 5, "lora_path": []}', '{"lora_name": {"a": 1}}',
              '{"lora_name": "\\ud800", "lora_path": "x"}', '{"lora_name": "a1", "lora_path": "\\u0000"}']  # fmt: skip
    async with _http(app) as http:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            for body in bodies:
                response = await http.post(route, content=body.encode(), headers=auth)
                assert 400 <= response.status_code < 500, (route, body, response.status_code, response.text)
        models = (await http.get("/v1/models", headers=auth)).json()["data"]  # still serving, nothing registered
        assert [m["id"] for m in models] == [MODEL, "a0"]
    assert sorted(lora_engine.loras) == ["a0"]


async def test_handle_api_over_the_scheduler_actor(tiny_opt_path, adapters, offline_texts, monkeypatch):
    """LLMServer -> SchedulerActor (its step thread; no Ray): `lora_name` on the handle API,
    adapters loaded and unloaded between steps, an unknown name refused with its own error."""
    from types import SimpleNamespace

    from rayserve_paged.core.lora import UnknownLoRAError
    from rayserve_paged.deployments import llm_server
    from rayserve_paged.deployments.errors import to_openai_error
    from rayserve_paged.deployments.llm_server import LLMServer
    from rayserve_paged.engine.scheduler_actor import SchedulerActor
    from rayserve_paged.models.lora import LoRAError
    from tests.deployments.test_llm_server import _LocalActor

    monkeypatch.setattr(llm_server, "ray", SimpleNamespace(get=lambda ref: ref))
    config = EngineConfig(
        model=tiny_opt_path, device="cpu", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, swap_space_gb=0.01,
        max_loras=1, max_lora_rank=16, lora_modules={"a0": adapters["a0"]}, lora_modules_root=adapters["root"],
    )  # fmt: skip
    actor = SchedulerActor(config, executor="in-process")
    server = LLMServer(config, scheduler_actor=_LocalActor(actor))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        assert await server.lora_adapters() == {"a0": adapters["a0"]}
        assert (await server.generate(PROMPT, params, lora_name="a0")).outputs[0].text == offline_texts["a0"]
        await server.load_lora_adapter("a1", adapters["a1"])
        assert await server.lora_adapters() == {"a0": adapters["a0"], "a1": adapters["a1"]}
        # one slot, two adapters at once: the second waits for the first to finish
        results = await asyncio.gather(*(server.generate(PROMPT, params, lora_name=n) for n in ("a1", "a0", None)))
        assert [r.outputs[0].text for r in results] == [offline_texts["a1"], offline_texts["a0"], offline_texts[None]]
        with pytest.raises(LoRAError, match="rank r=32 exceeds max_lora_rank 16"):
            await server.load_lora_adapter("big", adapters["big"])
        assert await server.unload_lora_adapter("a1") is True
        assert await server.unload_lora_adapter("a1") is False
        with pytest.raises(UnknownLoRAError, match="'a1' does not exist") as unknown:
            await server.generate(PROMPT, params, lora_name="a1")
        error = to_openai_error(unknown.value)
        assert (error.status_code, error.info.param, error.info.code) == (404, "model", "model_not_found")
    finally:
        await server.frontend.close()
        actor.shutdown()
    assert not actor.engine.has_unfinished_requests()


async def test_an_unloaded_start_up_adapters_id_is_never_reused(lora_client, lora_engine, adapters, offline_texts):
    """Unload the start-up adapter a0 (id 1), load a1 under a new name: a1 gets a new id,
    serves its own weights, and its first request finds none of a0's cached blocks."""
    app = create_openai_app(lora_client, lora_engine.tokenizer, MODEL, KEY, allow_runtime_lora_updating=True)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": LONG, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    hits = lora_engine.block_manager.counters
    try:
        async with _http(app) as http:
            first = await http.post("/v1/completions", headers=auth, json={"model": "a0", **body})
            assert first.json()["choices"][0]["text"] == offline_texts["a0", "long"]
            unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a0"}, headers=auth)
            assert unload.status_code == 200
            load = {"lora_name": "c", "lora_path": adapters["a1"]}
            assert (await http.post("/v1/load_lora_adapter", json=load, headers=auth)).status_code == 200
            assert lora_engine.loras["c"].lora_int_id > 1
            before = hits.prefix_cache_hits
            done = await http.post("/v1/completions", headers=auth, json={"model": "c", **body})
            assert done.json()["choices"][0]["text"] == offline_texts["a1", "long"]
            assert hits.prefix_cache_hits == before  # nothing of a0's chain
    finally:
        lora_engine.remove_lora("c")
        lora_engine.add_lora(LoRARequest("a0", 1, adapters["a0"]))  # back to the start-up set (the same adapter)


def _malformed(root: Path, outside: Path, a1: str) -> dict[str, str]:
    """name -> a lora_path the load route must refuse (4xx, lora_path), each holding 'SECRET'
    where a file's content could be echoed."""
    from safetensors.torch import load_file, save_file

    def variant(name: str, config=None, tensors=None) -> str:
        where = root / name
        shutil.copytree(a1, where)
        if config is not None:
            (where / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        if tensors is not None:
            weights = where / "adapter_model.safetensors"
            save_file(tensors(load_file(weights)), weights)
        return str(where)

    good = json.loads((Path(a1) / "adapter_config.json").read_text())

    def nan_first(tensors):
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].clone()
        tensors[name][0, 0] = float("nan")
        return tensors

    def wrong_shape(tensors):
        name = next(n for n in sorted(tensors) if "lora_A" in n)
        tensors[name] = tensors[name][:, :-1].contiguous()  # one input feature short
        return tensors

    shutil.copytree(a1, outside / "copy")
    (root / "escape").symlink_to(outside / "copy")
    return {
        "config-a-list": variant("config-a-list", '["SECRET", 1]'),
        "config-too-deep": variant("config-too-deep", '{"r": ' + "[" * 100_000 + "]" * 100_000 + ', "x": "SECRET"}'),
        "config-deep": variant("config-deep", {**good, "x": {"y": [[[[[[[[[[[[[[[[["SECRET"]]]]]]]]]]]]]]]]]}}),
        "config-not-json": variant("config-not-json", "SECRET {"),
        "alpha-nan": variant("alpha-nan", json.dumps({**good, "lora_alpha": float("nan")})),  # NaN, as Python writes it
        "alpha-inf": variant("alpha-inf", json.dumps({**good, "lora_alpha": float("inf")})),  # Infinity
        "r-a-string": variant("r-a-string", {**good, "r": "SECRET"}),
        "peft-type": variant("peft-type", {**good, "peft_type": "SECRET"}),
        "unknown-target": variant("unknown-target", {**good, "target_modules": ["q_proj", "not_a_module"]}),
        "weights-nan": variant("weights-nan", tensors=nan_first),
        "shape-mismatch": variant("shape-mismatch", tensors=wrong_shape),
        "weights-garbage": variant("weights-garbage"),
        "rank-too-big": str(root / "big"),
        "relative": "a1",
        "dot-dot": f"{root}/../{outside.name}/copy",
        "symlink-out": str(root / "escape"),
        "proc": "/proc/self/cwd",
        "missing": str(root / "SECRET-nowhere"),
        "name-too-long": f"{root}/" + "x" * (4096 - len(str(root)) - 1),
        "component-too-long": f"{root}/" + "y" * 300,
    }


async def test_every_malformed_adapter_is_a_4xx_that_registers_nothing(lora_client, lora_engine, adapters, tmp_path):
    root = Path(adapters["root"])
    cases = _malformed(root, tmp_path, adapters["a1"])
    (Path(cases["weights-garbage"]) / "adapter_model.safetensors").write_bytes(b"SECRET" * 100)
    app = create_openai_app(lora_client, lora_engine.tokenizer, MODEL, KEY, allow_runtime_lora_updating=True)
    auth = {"Authorization": f"Bearer {KEY}"}
    before = dict(lora_engine.loras), dict(lora_engine._lora_bytes)
    async with _http(app) as http:
        for case, path in cases.items():
            body = {"lora_name": "bad", "lora_path": path}
            response = await http.post("/v1/load_lora_adapter", json=body, headers=auth)
            error = assert_openai_error(response, 400, "lora_path")
            assert "SECRET" not in error["message"], (case, error)
            assert (dict(lora_engine.loras), dict(lora_engine._lora_bytes)) == before, case
        for case, words in (("alpha-nan", "NaN"), ("config-too-deep", "nested too deeply"),
                            ("config-deep", "nested too deeply"), ("config-a-list", "must hold a JSON object"),
                            ("weights-nan", "NaN or infinite weights"), ("unknown-target", "'not_a_module' is unknown"),
                            ("shape-mismatch", "shape mismatch"), ("symlink-out", "under lora_modules_root"),
                            ("name-too-long", "cannot be read")):  # fmt: skip
            response = await http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": cases[case]},
                                       headers=auth)  # fmt: skip
            assert_openai_error(response, 400, "lora_path", words)
        body = {"lora_name": "a1", "lora_path": adapters["a1"]}
        ok = await http.post("/v1/load_lora_adapter", json=body, headers=auth)
        assert ok.status_code == 200  # the replica still loads a good adapter
