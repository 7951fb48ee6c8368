"""Ray Serve LLM's `llm_configs` (its documentation's example shapes, import_path changed)
mapped onto AppArgs: every engine_kwargs name of the table, LLMConfig's fields, the errors
that name what cannot be honoured, and the deployments build_openai_app binds. No Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayserve_paged.app import AppArgs, build_app, build_openai_app, placement_group_bundles
from rayserve_paged.config import SpeculativeDecodingConfig
from rayserve_paged.serve_llm import (
    ENGINE_KWARGS,
    LLM_CONFIG_FIELDS,
    UNSUPPORTED_ENGINE_KWARGS,
    LLMConfigError,
    llm_config_table,
    mapping_table,
    translate,
)
from tests.deployments.conftest import record_binds

ROOT = Path(__file__).resolve().parents[2]
OWN = frozenset(AppArgs.model_fields)

# Ray Serve LLM's documented shapes (ray.serve.llm.build_openai_app's docstring and the
# Serve LLM guides), import_path changed; three of them open with the same application
QWEN_05B = """
applications:
- name: llm_app
  route_prefix: "/"
  import_path: rayserve_paged.app:build_openai_app
  args:
    llm_configs:
      - model_loading_config:
          model_id: qwen-0.5b
          model_source: Qwen/Qwen2.5-0.5B-Instruct
"""
ONE_MODEL = QWEN_05B + """        accelerator_type: A10G
        deployment_config:
          autoscaling_config:
            min_replicas: 1
            max_replicas: 2
"""
TWO_MODELS = """
applications:
- args:
    llm_configs:
        - model_loading_config:
            model_id: qwen-0.5b
            model_source: Qwen/Qwen2.5-0.5B-Instruct
          accelerator_type: A10G
          deployment_config:
            autoscaling_config:
                min_replicas: 1
                max_replicas: 2
        - model_loading_config:
            model_id: qwen-1.5b
            model_source: Qwen/Qwen2.5-1.5B-Instruct
          accelerator_type: A10G
          deployment_config:
            autoscaling_config:
                min_replicas: 1
                max_replicas: 2
  import_path: rayserve_paged.app:build_openai_app
  name: llm_app
  route_prefix: "/"
"""
WITH_LORA = QWEN_05B + """        lora_config:
          dynamic_lora_loading_path: s3://my_dynamic_lora_path_bucket
          max_num_adapters_per_replica: 16
        engine_kwargs:
          max_model_len: 8192
          enable_lora: true
          max_lora_rank: 32
          max_loras: 16
        deployment_config:
          autoscaling_config:
            min_replicas: 1
            max_replicas: 2
        accelerator_type: A10G
"""
WITH_AUTOSCALING = QWEN_05B + """        engine_kwargs:
          tensor_parallel_size: 2
          max_model_len: 8192
          gpu_memory_utilization: 0.85
          enable_prefix_caching: true
          max_num_seqs: 64
        deployment_config:
          max_ongoing_requests: 64
          autoscaling_config:
            min_replicas: 1
            initial_replicas: 1
            max_replicas: 4
            target_ongoing_requests: 32
            upscale_delay_s: 10
            downscale_delay_s: 300
        accelerator_type: L4
"""


def _args(text: str) -> dict:
    (app,) = yaml.safe_load(text)["applications"]
    assert app["import_path"] == "rayserve_paged.app:build_openai_app"
    return app["args"]


def _recorded(monkeypatch, args: dict) -> dict[str, dict]:
    return record_binds(monkeypatch, args, build_openai_app)


def test_one_model_is_served_in_one_hop_under_its_id_on_its_accelerator(monkeypatch):
    bound = _recorded(monkeypatch, _args(ONE_MODEL))
    (name,) = bound
    assert name == "LLMServer:qwen-0_5b"  # Ray Serve LLM's deployment name
    options, (engine,), kwargs = bound[name]["options"], bound[name]["args"], bound[name]["kwargs"]
    assert bound[name]["cls"].__name__ == "LLMServer"  # the HTTP app runs in the replica
    assert engine["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and engine["device"] == "cuda"
    assert kwargs["http"]["served_model_name"] == "qwen-0.5b"
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2}
    assert "num_replicas" not in options
    gpu_bundles = [b for b in options["placement_group_bundles"] if "GPU" in b]
    assert gpu_bundles == [{"CPU": 1.1, "GPU": 1.0, "accelerator_type:A10G": 0.001}] or all(
        b["accelerator_type:A10G"] == 0.001 for b in gpu_bundles
    )
    assert gpu_bundles and not any("accelerator_type:A10G" in b for b in options["placement_group_bundles"] if "GPU" not in b)


def test_two_models_get_a_deployment_each_behind_one_ingress(monkeypatch):
    bound = _recorded(monkeypatch, _args(TWO_MODELS))
    assert set(bound) == {"LLMServer:qwen-0_5b", "LLMServer:qwen-1_5b", "OpenAIIngress"}
    ingress = bound["OpenAIIngress"]
    assert ingress["cls"].__name__ == "MultiModelIngress"
    (models,) = ingress["args"]
    assert [m["model_id"] for m in models] == ["qwen-0.5b", "qwen-1.5b"]
    assert [m["deployment_name"] for m in models] == ["LLMServer:qwen-0_5b", "LLMServer:qwen-1_5b"]
    for m in models:  # each model's handle is its own deployment, with its own autoscaling
        assert m["handle"] is bound[m["deployment_name"]]
        assert m["handle"]["options"]["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2}
        assert m["handle"]["cls"].__name__ == "ModelServer"
        assert m["http"]["served_model_name"] == m["model_id"]
    assert [m["handle"]["args"][0]["model"] for m in models] == ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"]


def test_lora_from_cloud_storage_is_refused_naming_the_key():
    with pytest.raises(LLMConfigError, match=r"llm_configs\[0\] \(qwen-0.5b\).lora_config.dynamic_lora_loading_path: a local"):
        build_openai_app(_args(WITH_LORA))


def _adapter_dir(root: Path, *names: str) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "adapter_config.json").write_text("{}")
    (root / "not-an-adapter").mkdir()
    return root


def test_lora_from_a_local_directory_registers_its_adapters_under_rays_ids(tmp_path, monkeypatch):
    args = _args(WITH_LORA)
    root = _adapter_dir(tmp_path / "loras", "sql", "chat")
    args["llm_configs"][0]["lora_config"]["dynamic_lora_loading_path"] = str(root)
    (spec,) = translate(args, OWN).models
    model = AppArgs(**spec.args)
    assert model.lora_modules == {"qwen-0.5b:chat": str(root / "chat"), "qwen-0.5b:sql": str(root / "sql")}
    assert model.enable_lora and model.max_loras == 16 and model.max_cpu_loras == 16 and model.max_lora_rank == 32
    assert model.max_model_len == 8192


def test_max_num_adapters_per_replica_sets_slots_unless_max_loras_does(tmp_path):
    root = _adapter_dir(tmp_path / "loras", "a")
    entry = {"model_loading_config": {"model_id": "m", "model_source": "tiny-llama"},
             "lora_config": {"dynamic_lora_loading_path": str(root), "max_num_adapters_per_replica": 4}}  # fmt: skip
    (spec,) = translate({"llm_configs": [entry]}, OWN).models
    assert (spec.args["max_loras"], spec.args["max_cpu_loras"]) == (4, 4)
    entry["engine_kwargs"] = {"max_loras": 2}
    (spec,) = translate({"llm_configs": [entry]}, OWN).models
    assert (spec.args["max_loras"], spec.args["max_cpu_loras"]) == (2, 4)  # 2 device slots, 4 held per replica


def test_autoscaling_shape_keeps_every_option(monkeypatch):
    bound = _recorded(monkeypatch, _args(WITH_AUTOSCALING))
    (record,) = bound.values()
    options, engine = record["options"], record["args"][0]
    assert options["max_ongoing_requests"] == 64
    assert options["autoscaling_config"] == {
        "min_replicas": 1, "initial_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32,
        "upscale_delay_s": 10, "downscale_delay_s": 300,
    }  # fmt: skip
    assert (engine["tensor_parallel_size"], engine["max_model_len"], engine["gpu_memory_utilization"]) == (2, 8192, 0.85)
    assert (engine["enable_prefix_caching"], engine["max_num_seqs"]) == (True, 64)
    ranks = options["placement_group_bundles"][1:]  # one bundle per TP rank, each on an L4
    assert len(ranks) == 2 and all(b["GPU"] == 1 and b["accelerator_type:L4"] == 0.001 for b in ranks)


# one value per entry of the table, and the field value it becomes
ENGINE_VALUES = {
    "tensor_parallel_size": (2, 2), "max_model_len": (512, 512), "max_num_seqs": (8, 8),
    "max_num_batched_tokens": (1024, 1024), "block_size": (32, 32), "enable_prefix_caching": (False, False),
    "enable_chunked_prefill": (False, False), "gpu_memory_utilization": (0.5, 0.5),
    "kv_cache_memory_bytes": (2**29, 0.5), "num_gpu_blocks_override": (100, 100), "swap_space": (2, 2),
    "kv_offloading_size": (1.5, 1.5),
    "preemption_mode": ("swap", "swap"), "dtype": ("half", "float16"), "quantization": (None, "auto"),
    "seed": (None, 0), "enforce_eager": (True, True), "max_logprobs": (5, 5), "trust_remote_code": (True, True),
    "tokenizer": ("/tmp/tok", "/tmp/tok"), "device": ("cpu", "cpu"), "enable_lora": (True, True),
    "max_loras": (3, 3), "max_lora_rank": (32, 32), "max_cpu_loras": (4, 4), "tool_call_parser": ("hermes", "hermes"),
    "reasoning_parser": ("qwen3", "qwen3"), "scheduling_policy": ("priority", "priority"),
    "speculative_config": ({"method": "ngram", "num_speculative_tokens": 2},
                           SpeculativeDecodingConfig(method="ngram", num_speculative_tokens=2)),
    "chat_template": ("{{ messages[0]['content'] }}", "{{ messages[0]['content'] }}"),
}  # fmt: skip
CHECKED = {
    "enable_auto_tool_choice": True, "structured_outputs_config": {"backend": "guidance"},
    "guided_decoding_backend": "auto", "served_model_name": "m",
    "pipeline_parallel_size": 1, "data_parallel_size": 1, "distributed_executor_backend": "ray",
}  # fmt: skip


def test_the_table_is_tested_whole():
    assert set(ENGINE_VALUES) | set(CHECKED) == set(ENGINE_KWARGS)
    listed = {"tensor_parallel_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
              "enable_prefix_caching", "enable_chunked_prefill", "gpu_memory_utilization", "swap_space",
              "preemption_mode", "dtype", "quantization", "seed", "enforce_eager", "enable_lora", "max_loras",
              "max_lora_rank", "max_cpu_loras", "speculative_config", "structured_outputs_config",
              "guided_decoding_backend", "tool_call_parser", "reasoning_parser", "enable_auto_tool_choice",
              "chat_template", "served_model_name", "scheduling_policy"}  # the list  # fmt: skip
    assert listed <= set(ENGINE_KWARGS) | set(UNSUPPORTED_ENGINE_KWARGS)


@pytest.mark.parametrize("name", sorted(ENGINE_VALUES))
def test_each_vllm_name_sets_its_field(name):
    value, expected = ENGINE_VALUES[name]
    kwargs = {name: value} | ({"enable_chunked_prefill": True} if name == "max_num_batched_tokens" else {})
    kwargs |= {"tool_call_parser": "hermes"} if name == "enable_auto_tool_choice" else {}
    entry = {"model_loading_config": {"model_id": "m", "model_source": "tiny-opt"}, "engine_kwargs": kwargs}
    (spec,) = translate({"llm_configs": [entry]}, OWN).models
    args = AppArgs(**spec.args)
    assert getattr(args, ENGINE_KWARGS[name].field) == expected


@pytest.mark.parametrize("name", sorted(CHECKED))
def test_each_checked_vllm_name_is_accepted_at_what_it_means_here(name):
    kwargs = {name: CHECKED[name]} | ({"tool_call_parser": "hermes"} if name == "enable_auto_tool_choice" else {})
    entry = {"model_loading_config": {"model_id": "m", "model_source": "tiny-opt"}, "engine_kwargs": kwargs}
    (spec,) = translate({"llm_configs": [entry]}, OWN).models
    AppArgs(**spec.args)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        *[({name: {}}, [f"engine_kwargs.{name}", reason]) for name, reason in UNSUPPORTED_ENGINE_KWARGS.items()],
        ({"no_such_arg": 1}, ["engine_kwargs.no_such_arg", "not an engine option here"]),
        ({"structured_outputs_config": {"backend": "xgrammar"}}, ["structured_outputs_config", "llguidance"]),
        ({"guided_decoding_backend": "outlines"}, ["guided_decoding_backend", "llguidance"]),
        ({"scheduling_policy": "lottery"}, ["scheduling_policy"]),
        ({"pipeline_parallel_size": 2}, ["pipeline_parallel_size", "only 1"]),
        ({"served_model_name": "other"}, ["served_model_name", "model_id"]),
        ({"enable_auto_tool_choice": True}, ["enable_auto_tool_choice", "needs tool_call_parser"]),
        ({"swap_space": 1, "swap_space_gb": 2}, ["swap_space_gb", "engine_kwargs.swap_space already set otherwise"]),
        ({"kv_cache_memory_bytes": -1}, ["kv_cache_memory_bytes", "positive number of bytes"]),
    ],
)
def test_an_unsupported_engine_kwarg_fails_start_up_naming_it(kwargs, words):
    """Nothing is ignored: each key the engine cannot honour stops the build, naming the key
    and what there is instead."""
    entry = {"model_loading_config": {"model_id": "m", "model_source": "tiny-opt"}, "engine_kwargs": kwargs}
    with pytest.raises(LLMConfigError) as failure:
        build_openai_app({"llm_configs": [entry]})
    for word in words:
        assert word in str(failure.value)
    assert str(failure.value).startswith("llm_configs[0] (m)")


@pytest.mark.parametrize(
    "entry, words",
    [
        ({"server_cls": "x:Y"}, ["server_cls", "LLMServer"]),
        ({"llm_engine": "SGLang"}, ["llm_engine", "vLLM"]),
        ({"accelerator_type": "NoSuchGPU"}, ["accelerator_type", "Ray's accelerator types"]),
        ({"accelerator_type": "TPU-V4"}, ["accelerator_type", "TPUs"]),
        ({"accelerator_config": {"kind": "tpu"}}, ["accelerator_config.kind"]),
        ({"placement_group_config": {"bundles": [{"CPU": 1}]}}, ["placement_group_config.bundles"]),
        ({"deployment_config": {"user_config": {}}}, ["deployment_config.user_config"]),
        ({"deployment_config": {"num_replicas": 2, "autoscaling_config": {}}}, ["deployment_config.num_replicas"]),
        ({"lora_config": {"download_timeout_s": 5}}, ["lora_config.download_timeout_s", "nothing is downloaded"]),
        ({"experimental_configs": {"require_api_key": True}}, ["experimental_configs.require_api_key", "next to llm_configs"]),
        ({"no_such_field": 1}, ["no_such_field", "not a field"]),
        ({"model_loading_config": {"model_id": "m", "model_source": {"bucket_uri": "s3://b/m"}}}, ["model_source", "cloud"]),
        ({"engine_kwargs": {"max_num_seqs": 0}}, ["engine_kwargs.max_num_seqs:", "greater than or equal to 1"]),
        ({"engine_kwargs": {"swap_space": -1}}, ["engine_kwargs.swap_space (swap_space_gb here)"]),
    ],
)
def test_an_unsupported_llm_config_field_fails_start_up_naming_it(entry, words):
    entry = {"model_loading_config": {"model_id": "m", "model_source": "tiny-opt"}} | entry
    with pytest.raises(LLMConfigError) as failure:
        build_openai_app({"llm_configs": [entry]})
    for word in words:
        assert word in str(failure.value)


def test_llm_configs_may_be_paths_to_yaml_files(tmp_path, monkeypatch):
    paths = []
    for model_id, source in (("a", "tiny-opt"), ("b", "tiny-llama")):
        path = tmp_path / f"{model_id}.yaml"
        path.write_text(yaml.safe_dump({"model_loading_config": {"model_id": model_id, "model_source": source}}))
        paths.append(str(path))
    bound = _recorded(monkeypatch, {"llm_configs": paths})
    assert {"LLMServer:a", "LLMServer:b", "OpenAIIngress"} == set(bound)
    with pytest.raises(LLMConfigError, match=r"llm_configs\[1\]: .* is not a file"):
        build_openai_app({"llm_configs": [paths[0], str(tmp_path / "missing.yaml")]})


def test_model_ids_and_adapter_names_are_unique_across_models(tmp_path):
    one = {"model_loading_config": {"model_id": "a", "model_source": "tiny-opt"}}
    with pytest.raises(LLMConfigError, match="'a' is given twice"):
        translate({"llm_configs": [one, one]}, OWN)
    clash = {"model_loading_config": {"model_id": "b", "model_source": "tiny-llama"},
             "experimental_configs": {"lora_modules": {"a": str(tmp_path)}}}  # fmt: skip
    with pytest.raises(LLMConfigError, match="adapter name 'a' of 'b' is already the name of 'a'"):
        translate({"llm_configs": [one, clash]}, OWN)


def test_deployment_config_options_go_to_serve(monkeypatch):
    from ray.serve.config import AutoscalingConfig

    entry = {
        "model_loading_config": {"model_id": "m", "model_source": "tiny-opt"},
        "deployment_config": {"num_replicas": "auto", "health_check_period_s": 7, "name": "mine",
                              "ray_actor_options": {"num_cpus": 0.2}},
        "runtime_env": {"env_vars": {"A": "1"}},
        "experimental_configs": {"stream_batching_interval_ms": 20, "worker_cpus": 0.5},
    }  # fmt: skip
    bound = _recorded(monkeypatch, {"llm_configs": [entry], "require_api_key": False})
    options = bound["mine"]["options"]
    assert options["autoscaling_config"] == AutoscalingConfig.default().model_dump(exclude_unset=True)
    assert options["health_check_period_s"] == 7
    assert options["ray_actor_options"] == {"num_cpus": 0.2, "runtime_env": {"env_vars": {"A": "1"}}}
    assert bound["mine"]["kwargs"]["stream_batching_interval_ms"] == 20
    assert bound["mine"]["kwargs"]["worker_cpus"] == 0.5


def test_ingress_deployment_config_and_app_wide_options(monkeypatch):
    models = [{"model_loading_config": {"model_id": m, "model_source": "tiny-opt"},
               "experimental_configs": {"num_ingress_replicas": n}} for m, n in (("a", 2), ("b", 3))]  # fmt: skip
    bound = _recorded(monkeypatch, {"llm_configs": models, "require_api_key": True, "max_request_body_bytes": 4096})
    ingress = bound["OpenAIIngress"]["options"]
    assert ingress["num_replicas"] == 3  # as Ray Serve LLM: the largest a model asks for
    (served,) = bound["OpenAIIngress"]["args"]
    assert all(m["http"]["require_api_key"] and m["http"]["max_request_body_bytes"] == 4096 for m in served)
    bound = _recorded(monkeypatch, {"llm_configs": models, "ingress_deployment_config": {
        "num_replicas": 1, "max_ongoing_requests": 50, "ray_actor_options": {"num_cpus": 0.05}}})  # fmt: skip
    ingress = bound["OpenAIIngress"]["options"]
    assert (ingress["num_replicas"], ingress["max_ongoing_requests"], ingress["ray_actor_options"]) == (
        1, 50, {"num_cpus": 0.05})


def test_the_flat_args_keep_working_and_take_llm_configs_too(monkeypatch):
    assert build_app({"model": "tiny-opt", "device": "cpu"}) is not None
    bound = _recorded(monkeypatch, {"llm_configs": [{"model_loading_config": {"model_id": "x", "model_source": "tiny-opt"}}]})
    assert list(bound) == ["LLMServer:x"]
    args = AppArgs(model="tiny-opt", device="cuda", accelerator_type="H100")
    assert all(b["accelerator_type:H100"] == 0.001 for b in placement_group_bundles(args)[1:])


@pytest.mark.parametrize("doc", ["API.md", "DEPLOY.md"])
def test_the_docs_carry_the_tables_of_the_code(doc):
    text = (ROOT / "docs" / doc).read_text()
    assert mapping_table() in text
    if doc == "DEPLOY.md":
        assert llm_config_table() in text
        assert "Coming from Ray Serve LLM" in text
    assert len(LLM_CONFIG_FIELDS) > 10


def test_routing_prefix_applies_per_model(monkeypatch):
    """Each model under `routing: prefix` gets its own PrefixAffinityRouter over its own
    replicas; the other model keeps Serve's router."""
    models = [
        {"model_loading_config": {"model_id": "chat", "model_source": "tiny-llama"},
         "experimental_configs": {"routing": "prefix", "routing_imbalance_threshold": 3}},
        {"model_loading_config": {"model_id": "base", "model_source": "tiny-opt"}},
    ]  # fmt: skip
    bound = _recorded(monkeypatch, {"llm_configs": models})
    chat, base = bound["LLMServer:chat"], bound["LLMServer:base"]
    assert chat["cls"].__name__ == "RoutedLLMServer" and base["cls"].__name__ == "ModelServer"
    router = chat["options"]["request_router_config"]
    assert router["request_router_class"].endswith("PrefixAffinityRouter")
    assert router["request_router_kwargs"]["imbalance_threshold"] == 3
    assert "request_router_config" not in base["options"]
    # one model under prefix routing is served through the ingress too (the router needs it)
    assert set(_recorded(monkeypatch, {"llm_configs": models[:1]})) == {"LLMServer:chat", "OpenAIIngress"}


def test_chat_template_is_read_when_the_app_is_built(tmp_path):
    from rayserve_paged.app import http_options_of

    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert http_options_of(AppArgs(model="tiny-opt", chat_template=str(path)))["chat_template"] == path.read_text()
    inline = "{{ messages[0]['content'] }}"
    assert http_options_of(AppArgs(model="tiny-opt", chat_template=inline))["chat_template"] == inline
    assert http_options_of(AppArgs(model="tiny-opt"))["chat_template"] is None
    with pytest.raises(ValueError, match="chat_template: .* neither a readable file nor a Jinja template"):
        http_options_of(AppArgs(model="tiny-opt", chat_template=str(tmp_path / "missing.jinja")))


def test_the_lora_root_and_the_scheduling_policy_take_vllms_values(tmp_path):
    """dynamic_lora_loading_path registers its adapters at start-up and is the load root of
    runtime loads; scheduling_policy priority reaches the engine's option."""
    root = _adapter_dir(tmp_path / "loras", "a")
    entry = {"model_loading_config": {"model_id": "m", "model_source": "tiny-llama"},
             "engine_kwargs": {"scheduling_policy": "priority"},
             "lora_config": {"dynamic_lora_loading_path": str(root)}}  # fmt: skip
    (spec,) = translate({"llm_configs": [entry]}, OWN).models
    assert spec.args["scheduling_policy"] == "priority" and spec.args["lora_modules_root"] == str(root)
    assert spec.args["lora_modules"] == {"m:a": str(root / "a")}
    args = AppArgs(**spec.args)
    assert args.scheduling_policy == "priority" and args.lora_modules_root == [str(root)]


