"""Ray Serve LLM's llm_configs on the session cluster (import_path changed; tiny models, a
local LoRA directory and a CPU in place of hub ids, cloud storage and an A10G): two models,
one with LoRA, each autoscaled, behind one OpenAI ingress; and one model, served in one hop.

- start-up succeeds; /v1/models lists each model and each adapter; a chat to each answers;
  the engine options arrive as given (read back from each model's engine);
- under load on one model, its requests land on its own deployment and it scales out while
  the other model's deployment stays as it was (each autoscales on its own)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray

from rayserve_paged.deployments.fleet_metrics import SCHEDULER_NAMESPACE, fleet_scheduler_names

pytestmark = pytest.mark.ray

APP = "servellm"
AUTOSCALING = {
    "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 1,
    "upscale_delay_s": 1, "downscale_delay_s": 600, "metrics_interval_s": 1, "look_back_period_s": 2,
}  # fmt: skip
SMALL = {"ray_actor_options": {"num_cpus": 0.05}}  # + experimental_configs below: 0.3 CPUs per replica


def _llm_configs(lora_root: str) -> dict:
    """Ray Serve LLM's args (its LoRA and autoscaling examples' shapes)."""
    cpus = {"scheduler_cpus": 0.05, "worker_cpus": 0.2}
    return {
        "llm_configs": [
            {
                "model_loading_config": {"model_id": "llama-chat", "model_source": "tiny-llama"},
                "lora_config": {"dynamic_lora_loading_path": lora_root, "max_num_adapters_per_replica": 2},
                "engine_kwargs": {
                    "enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_model_len": 256,
                    "max_num_seqs": 6, "block_size": 8, "enable_prefix_caching": False, "device": "cpu",
                    "kv_cache_memory_bytes": 32 << 20, "swap_space": 0.01,
                },  # fmt: skip
                "deployment_config": {"autoscaling_config": AUTOSCALING, **SMALL},
                "experimental_configs": cpus,
            },
            {
                "model_loading_config": {"model_id": "opt-base", "model_source": "tiny-opt"},
                "engine_kwargs": {"max_model_len": 448, "max_num_seqs": 4, "device": "cpu", "seed": 3,
                                  "enable_prefix_caching": False, "kv_cache_memory_bytes": 32 << 20,
                                  "swap_space": 0.01},  # fmt: skip
                "deployment_config": {"autoscaling_config": AUTOSCALING, "max_ongoing_requests": 16, **SMALL},
                "experimental_configs": cpus,
            },
        ],
        "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0.05}},
    }


@pytest.fixture
def lora_root(ray_cluster, tmp_path_factory) -> str:
    """A local dynamic_lora_loading_path: two random PEFT adapters for tiny-llama."""
    from rayserve_paged.models.tiny import resolve_model
    from tests.peft_adapters import write_adapter

    root = tmp_path_factory.mktemp("ray-serve-llm-loras")
    base = resolve_model("tiny-llama")
    write_adapter(base, root / "a0", "llama", "all", 8, 16, seed=1)
    write_adapter(base, root / "a1", "llama", "mlp", 4, 8, seed=2)
    return str(root)


def _engines() -> dict[str, list]:
    """Each model's scheduler actors, by the checkpoint their engine loaded."""
    engines: dict[str, list] = {}
    for name in fleet_scheduler_names(APP):
        actor = ray.get_actor(name, namespace=SCHEDULER_NAMESPACE)
        engines.setdefault(ray.get(actor.model_info.remote())["model"], []).append(actor)
    return engines


def _read(actor) -> tuple[dict, int]:
    """(the engine's config, prompt tokens it has computed), read from the engine itself."""
    return ray.get(actor.__ray_call__.remote(lambda self: (self.engine.config.model_dump(), self.engine.num_prompt_tokens)))


def _chat(base: str, model: str, content: str = "Hi", max_tokens: int = 4) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _replicas_of_app() -> dict[str, dict[str, int]]:
    from ray import serve

    return {name: dict(d.replica_states) for name, d in serve.status().applications[APP].deployments.items()}


def _replicas(deployment: str) -> dict[str, int]:
    return _replicas_of_app()[deployment]


def test_two_models_each_listed_answering_on_its_own_deployment_autoscaled_on_its_own(
    serve_session, serve_port, lora_root
):
    from rayserve_paged.app import build_openai_app

    serve_session.run(build_openai_app(_llm_configs(lora_root)), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{serve_port}"
    # -- start-up: every model listed, each answers, each engine runs the options it was given
    listed = [card["id"] for card in httpx.get(f"{base}/v1/models", timeout=60).json()["data"]]
    assert listed == ["llama-chat", "llama-chat:a0", "llama-chat:a1", "opt-base"]
    for model in ("llama-chat", "llama-chat:a0", "opt-base"):
        answer = _chat(base, model)
        assert answer["model"] == model and answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] > 0
    engines = _engines()
    assert {k: len(v) for k, v in engines.items()} == {"tiny-llama": 1, "tiny-opt": 1}
    (llama_config, _), (opt_config, _) = _read(engines["tiny-llama"][0]), _read(engines["tiny-opt"][0])
    llama_options = ("max_num_seqs", "block_size", "max_model_len", "enable_prefix_caching", "max_loras",
                     "max_cpu_loras", "max_lora_rank", "enable_lora", "kv_cache_memory_gb", "swap_space_gb", "device")  # fmt: skip
    assert [llama_config[k] for k in llama_options] == [6, 8, 256, False, 1, 2, 8, True, 32 / 1024, 0.01, "cpu"]
    assert sorted(llama_config["lora_modules"]) == ["llama-chat:a0", "llama-chat:a1"]
    assert [opt_config[k] for k in ("max_num_seqs", "max_model_len", "seed", "block_size")] == [4, 448, 3, 16]
    # one ingress for both models; each model its own deployment
    assert set(_replicas_of_app()) == {"OpenAIIngress", "LLMServer:llama-chat", "LLMServer:opt-base"}

    # -- load on one model: its requests land on its deployment, which alone scales out
    (llama,) = _engines()["tiny-llama"]
    _, llama_before = _read(llama)

    async def load() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=300) as http:
            body = {"model": "opt-base", "prompt": "keep the replica busy", "max_tokens": 400, "ignore_eos": True,
                    "temperature": 1.0, "seed": 1}  # fmt: skip
            streams = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(6)]
            prompt_tokens = []
            deadline = time.monotonic() + 120
            while _replicas("LLMServer:opt-base").get("RUNNING", 0) < 2:
                assert time.monotonic() < deadline, _replicas_of_app()
                # one request at a time to the other model: below its target, it must not scale
                answer = await http.post("/v1/chat/completions", json={
                    "model": "llama-chat", "messages": [{"role": "user", "content": "short"}], "max_tokens": 2})  # fmt: skip
                assert answer.status_code == 200, answer.text
                prompt_tokens.append(answer.json()["usage"]["prompt_tokens"])
                await asyncio.sleep(0.5)
            for stream in streams:
                stream.cancel()
            return prompt_tokens

    llama_prompt_tokens = asyncio.run(load())
    assert _replicas("LLMServer:opt-base") == {"RUNNING": 2}
    assert _replicas("LLMServer:llama-chat") == {"RUNNING": 1}  # not scaled by the other model's load
    engines = _engines()
    assert len(engines["tiny-opt"]) == 2 and len(engines["tiny-llama"]) == 1
    # the llama engine computed exactly its own requests' prompts: none of the opt load reached it
    _, llama_after = _read(llama)
    assert llama_after - llama_before == sum(llama_prompt_tokens) > 0
    assert sum(_read(actor)[1] for actor in engines["tiny-opt"]) > 0


def test_one_model_shape_is_served_in_one_hop_under_its_id(serve_session, serve_port):
    """Ray Serve LLM's minimal example (one model, autoscaling_config) with a tiny model on
    a CPU: the replica serves HTTP itself (no ingress deployment)."""
    from rayserve_paged.app import build_openai_app

    serve = serve_session
    config = {"llm_configs": [{
        "model_loading_config": {"model_id": "qwen-0.5b", "model_source": "tiny-opt"},
        "accelerator_config": {"kind": "cpu"},
        "engine_kwargs": {"max_model_len": 320, "kv_cache_memory_bytes": 16 << 20, "swap_space": 0.01},
        "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}, **SMALL},
        "experimental_configs": {"scheduler_cpus": 0.05, "worker_cpus": 0.2},
    }]}  # fmt: skip
    serve.run(build_openai_app(config), name="servellm-one", route_prefix="/one")
    status = serve.status().applications["servellm-one"].deployments
    assert {name: dict(d.replica_states) for name, d in status.items()} == {"LLMServer:qwen-0_5b": {"RUNNING": 1}}
    base = f"http://127.0.0.1:{serve_port}/one"
    cards = httpx.get(f"{base}/v1/models", timeout=60).json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("qwen-0.5b", 320)]
    assert _chat(base, "qwen-0.5b")["model"] == "qwen-0.5b"
