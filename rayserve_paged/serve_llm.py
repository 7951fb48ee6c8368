"""Ray Serve LLM's application args (`llm_configs`) in this project's terms: no I/O beyond
reading the YAML files `llm_configs` names and listing each LoRA directory, no Ray.

    args: {llm_configs: [LLMConfig dict | path to a YAML file, ...],    (ray.serve.llm's shape)
           ingress_deployment_config: {...},   + AppArgs fields as app-wide defaults}
        │ translate()
        ▼
    ServeLLMSpec: one ModelSpec per entry (model id, deployment name, AppArgs fields, and
                  where each field came from) + the ingress deployment's Serve options

app.build_openai_app builds it: one LLMServer deployment (its own placement group per replica,
its own autoscaling) per model, behind one OpenAI ingress routing by `model`.

The mapping is ENGINE_KWARGS (vLLM engine-argument names -> EngineConfig / AppArgs fields)
and LLM_CONFIG_FIELDS (LLMConfig's fields); docs/API.md and docs/DEPLOY.md carry
mapping_table() (a test keeps them equal). A key this project cannot honour is an error that
names it and says what there is instead: nothing is ignored.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayserve_paged.config import EngineConfig


class LLMConfigError(ValueError):
    """An `llm_configs` entry this project cannot run as given (the message names the key)."""


@dataclass(frozen=True, slots=True)
class EngineArg:
    """One vLLM engine argument: the field it sets here, and how its value converts."""

    field: str | None  # None: accepted only as `check` allows, sets nothing
    note: str = ""
    convert: Callable[[Any], Any] | None = None  # value -> our value; raises ValueError with a reason


def _dtype(value):
    aliases = {"half": "float16", "float": "float32"}
    return aliases.get(value, value)


def _quantization(value):
    return "auto" if value is None else value


def _seed(value):
    return 0 if value is None else value


def _gib(value):
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError("expected a positive number of bytes")
    return value / 2**30


def _only(*allowed):
    def check(value):
        if value not in allowed:
            raise ValueError(f"only {' or '.join(repr(a) for a in allowed)} here (got {value!r})")
        return value

    return check


def _structured_outputs_backend(value):
    """vLLM's backend names: this project's grammars are llguidance's."""
    backend = value.get("backend", "auto") if isinstance(value, dict) else value
    if isinstance(value, dict) and set(value) - {"backend"}:
        raise ValueError(f"only `backend` is read here (got {sorted(value)})")
    if backend not in ("auto", "guidance", "llguidance"):
        raise ValueError(f"structured outputs use llguidance here: backend auto or guidance (got {backend!r})")
    return backend


# vLLM engine argument -> EngineConfig / AppArgs field. The one table (docs/API.md repeats it).
ENGINE_KWARGS: dict[str, EngineArg] = {
    "tensor_parallel_size": EngineArg("tensor_parallel_size"),
    "max_model_len": EngineArg("max_model_len"),
    "max_num_seqs": EngineArg("max_num_seqs"),
    "max_num_batched_tokens": EngineArg("max_num_batched_tokens"),
    "block_size": EngineArg("block_size", "8, 16 or 32"),
    "enable_prefix_caching": EngineArg("enable_prefix_caching"),
    "enable_chunked_prefill": EngineArg("enable_chunked_prefill"),
    "gpu_memory_utilization": EngineArg("gpu_memory_utilization"),
    "kv_cache_memory_bytes": EngineArg("kv_cache_memory_gb", "bytes / 2^30", _gib),
    "num_gpu_blocks_override": EngineArg("num_gpu_blocks_override"),
    "swap_space": EngineArg("swap_space_gb", "GiB per TP rank, as vLLM's"),
    "kv_offloading_size": EngineArg("kv_offload_memory_gb", "GiB of host memory per TP rank (tier 2)"),
    "preemption_mode": EngineArg("preemption_mode", "recompute, swap (and `auto`, this project's default)"),
    "dtype": EngineArg("dtype", "auto, float16 (half), bfloat16, float32 (float)", _dtype),
    "quantization": EngineArg("quantization", "null = auto; gguf, awq, gptq, fp8", _quantization),
    "seed": EngineArg("seed", "null = 0", _seed),
    "enforce_eager": EngineArg("enforce_eager"),
    "max_logprobs": EngineArg("max_logprobs"),
    "trust_remote_code": EngineArg("trust_remote_code"),
    "tokenizer": EngineArg("tokenizer"),
    "device": EngineArg("device", "auto, cpu, cuda"),
    "enable_lora": EngineArg("enable_lora"),
    "max_loras": EngineArg("max_loras", "device slots"),
    "max_lora_rank": EngineArg("max_lora_rank", "at most 64"),
    "max_cpu_loras": EngineArg("max_cpu_loras"),
    "tool_call_parser": EngineArg("tool_call_parser", "hermes, llama3_json, mistral, pythonic"),
    "reasoning_parser": EngineArg("reasoning_parser", "qwen3, deepseek_r1"),
    "chat_template": EngineArg("chat_template", "the template's text, or a file holding it"),
    "enable_auto_tool_choice": EngineArg(
        None, "true needs tool_call_parser (tool_choice `auto` is parsed whenever a parser is set)"
    ),
    "structured_outputs_config": EngineArg(
        None, "`backend`: auto or guidance (grammars are llguidance's)", _structured_outputs_backend
    ),
    "guided_decoding_backend": EngineArg(None, "auto or guidance (llguidance)", _structured_outputs_backend),
    "served_model_name": EngineArg(None, "must equal model_loading_config.model_id (the served name)"),
    "speculative_config": EngineArg(
        "speculative_config",
        "method ngram (prompt_lookup_min/max) or draft_model (model; tensor_parallel_size 1), num_speculative_tokens, "
        "disable_by_batch_size, min_accepted_per_step",
    ),
    "scheduling_policy": EngineArg("scheduling_policy", "fcfs or priority (per-request `priority`, lower first)"),
    "pipeline_parallel_size": EngineArg(None, "1 (tensor parallelism only)", _only(1)),
    "data_parallel_size": EngineArg(None, "1 (replicas are Serve's: deployment_config)", _only(1)),
    "distributed_executor_backend": EngineArg(None, "ray (worker actors in the replica's placement group)", _only("ray")),
}

# vLLM engine arguments with no equivalent here, and what there is instead
UNSUPPORTED_ENGINE_KWARGS: dict[str, str] = {
    "kv_cache_dtype": "the KV cache is kept in `dtype`",
    "cpu_offload_gb": "weights stay on the device; swap_space sizes the KV swap pool",
    "load_format": "the format is read from model_source (safetensors directory or .gguf file)",
    "kv_transfer_config": "no prefill/decode disaggregation; KV blocks move only within a replica",
    "enable_expert_parallel": "no mixture-of-experts models here",
    "max_seq_len_to_capture": "decode buckets are built from max_num_seqs (enforce_eager turns them off)",
    "disable_log_stats": "engine metrics are always exported (/metrics)",
    "lora_extra_vocab_size": "adapters may not extend the vocabulary",
    "model": "model_loading_config.model_source names the checkpoint",
}

# this project's own engine options are also accepted in engine_kwargs, under their names
OWN_ENGINE_FIELDS = frozenset(EngineConfig.model_fields) - {"model"}

# LLMConfig's fields: where each goes (docs/DEPLOY.md repeats this table)
LLM_CONFIG_FIELDS: dict[str, str] = {
    "model_loading_config.model_id": "the served name (`model` in requests, /v1/models); the deployment is "
    "`LLMServer:<model_id>`",
    "model_loading_config.model_source": "`model`: a local HF directory, a .gguf file, smollm2, tiny-opt / "
    "tiny-llama, or a hub id (default: model_id); no cloud mirrors",
    "model_loading_config.tokenizer_source": "`tokenizer`",
    "engine_kwargs": "the table below; this project's own EngineConfig names are accepted too",
    "deployment_config": "Serve options of the model's LLMServer: num_replicas (`auto` too), autoscaling_config, "
    "max_ongoing_requests, max_queued_requests, ray_actor_options, graceful_shutdown_*; any other "
    "serve.deployment option is passed to Serve; `name` names the deployment",
    "lora_config.dynamic_lora_loading_path": "a local directory: each subdirectory holding adapter_config.json "
    "is registered at start-up as `<model_id>:<subdirectory>` (lora_modules) and is the load root of runtime "
    "loads (lora_modules_root); no cloud storage",
    "lora_config.max_num_adapters_per_replica": "max_cpu_loras (adapters held per replica) and, unless "
    "engine_kwargs sets max_loras, max_loras (device slots)",
    "accelerator_type": "device cuda, and Ray's `accelerator_type:<type>` resource (0.001) in each GPU bundle",
    "accelerator_config.kind": "cpu -> device cpu; gpu -> device cuda",
    "placement_group_config": "`strategy` -> placement_group_strategy; `bundle_per_worker` (CPU, GPU) -> "
    "worker_cpus; whole `bundles` lists are not taken (the layout is one bundle per TP rank)",
    "runtime_env": "the replica's ray_actor_options.runtime_env (its scheduler and worker actors inherit it)",
    "experimental_configs": "stream_batching_interval_ms; num_ingress_replicas -> the ingress's replicas (the "
    "largest over models); any AppArgs field (routing, worker_cpus, max_pending_requests, ...)",
    "llm_engine": "vLLM only (the name Ray Serve LLM accepts; it means this engine)",
    "log_engine_metrics": "true only (metrics are always exported)",
}

# LLMConfig fields refused, and why
UNSUPPORTED_LLM_CONFIG_FIELDS: dict[str, str] = {
    "server_cls": "the server is this project's LLMServer",
    "callback_config": "no model-initialization callbacks",
}

# AppArgs fields that describe the application (the ingress), not one model: given once, at
# the top level of args, next to llm_configs
APP_WIDE_FIELDS = frozenset(
    {
        "require_api_key",
        "unauthenticated_paths",
        "max_request_body_bytes",
        "request_body_timeout_s",
        "ingress_cpus",
        "ingress_replicas",
        "ingress_max_ongoing_requests",
        "metrics_cache_s",
    }
)

# deployment_config keys that are AppArgs fields of the same name
DEPLOYMENT_FIELDS = frozenset(
    {
        "num_replicas",
        "autoscaling_config",
        "max_ongoing_requests",
        "max_queued_requests",
        "ray_actor_options",
        "graceful_shutdown_timeout_s",
        "graceful_shutdown_wait_loop_s",
    }
)

CLOUD_PREFIXES = ("s3://", "gs://", "abfss://", "azure://", "pyarrow-")


@dataclass(slots=True)
class ModelSpec:
    """One `llm_configs` entry: its served name, its deployment, and the AppArgs fields it sets
    (`sources`: field -> the key it came from, for errors)."""

    model_id: str
    where: str  # "llm_configs[i] (model_id)", what its errors begin with
    deployment_name: str
    args: dict[str, Any]
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    defaulted: set[str] = dataclasses.field(default_factory=set)  # fields set by app-wide defaults
    num_ingress_replicas: int | None = None  # experimental_configs.num_ingress_replicas


@dataclass(slots=True)
class ServeLLMSpec:
    models: list[ModelSpec]
    ingress_options: dict[str, Any]  # serve.deployment options of the ingress beyond AppArgs' ingress_*


def is_llm_configs(args: Any) -> bool:
    return isinstance(args, dict) and "llm_configs" in args


def deployment_name_of(model_id: str) -> str:
    """Ray Serve LLM's name for a model's deployment."""
    return "LLMServer:" + model_id.replace("/", "--").replace(".", "_")


def translate(args: dict[str, Any], own_fields: frozenset[str]) -> ServeLLMSpec:
    """`args` of ray.serve.llm:build_openai_app as this project's per-model AppArgs fields.
    `own_fields`: AppArgs' field names (app-wide defaults may be given next to llm_configs)."""
    args = dict(args)
    entries = args.pop("llm_configs")
    if not isinstance(entries, list) or not entries:
        raise LLMConfigError("llm_configs: expected a non-empty list of LLMConfigs (or paths to YAML files)")
    if args.pop("ingress_cls_config", None):
        raise LLMConfigError("ingress_cls_config: the ingress is this project's (no custom ingress class)")
    ingress = args.pop("ingress_deployment_config", None) or {}
    if not isinstance(ingress, dict):
        raise LLMConfigError("ingress_deployment_config: expected a mapping of Serve deployment options")
    unknown = sorted(set(args) - own_fields)
    if unknown:
        raise LLMConfigError(
            f"{unknown[0]}: not an argument of build_openai_app (llm_configs, ingress_deployment_config, or an "
            "AppArgs field as an app-wide default)"
        )
    defaults = args
    models = [_model_spec(i, _load_entry(i, entry), defaults, own_fields) for i, entry in enumerate(entries)]
    seen: dict[str, str] = {}
    for spec in models:
        if spec.model_id in seen:
            raise LLMConfigError(f"llm_configs: the model id {spec.model_id!r} is given twice (ids must be unique)")
        seen[spec.model_id] = spec.model_id
    for spec in models:
        for name in spec.args.get("lora_modules", {}):
            if name in seen:
                raise LLMConfigError(
                    f"llm_configs: the LoRA adapter name {name!r} of {spec.model_id!r} is already the name of "
                    f"{seen[name]!r} (names are unique across models)"
                )
            seen[name] = spec.model_id
    ingress_options = _ingress_options(ingress, models)
    return ServeLLMSpec(models, ingress_options)


def _load_entry(index: int, entry: Any) -> dict[str, Any]:
    """An llm_configs entry as a mapping: given inline, or a path to a YAML file (as Ray's builder)."""
    if isinstance(entry, dict):
        return entry
    if isinstance(entry, str):
        import yaml

        path = Path(entry)
        if not path.is_file():
            raise LLMConfigError(f"llm_configs[{index}]: {entry!r} is not a file (a path to an LLMConfig YAML file)")
        loaded = yaml.safe_load(path.read_text())
        if not isinstance(loaded, dict):
            raise LLMConfigError(f"llm_configs[{index}]: {entry!r} does not hold an LLMConfig mapping")
        return loaded
    raise LLMConfigError(f"llm_configs[{index}]: expected an LLMConfig mapping or a path to a YAML file")


def _model_spec(index: int, entry: dict[str, Any], defaults: dict[str, Any], own_fields: frozenset[str]) -> ModelSpec:
    entry = dict(entry)
    where = f"llm_configs[{index}]"
    loading = entry.pop("model_loading_config", None)
    if not isinstance(loading, dict) or not isinstance(loading.get("model_id"), str) or not loading["model_id"]:
        raise LLMConfigError(f"{where}.model_loading_config.model_id: required (the model's served name)")
    model_id = loading["model_id"]
    where = f"{where} ({model_id})"
    spec = ModelSpec(
        model_id, where, deployment_name_of(model_id), dict(defaults), {k: k for k in defaults}, set(defaults)
    )
    _model_loading(spec, loading)
    engine_kwargs = entry.pop("engine_kwargs", None) or {}
    if not isinstance(engine_kwargs, dict):
        raise LLMConfigError(f"{where}.engine_kwargs: expected a mapping")
    _engine_kwargs(spec, engine_kwargs, own_fields)
    _deployment_config(spec, entry.pop("deployment_config", None) or {})
    _lora_config(spec, entry.pop("lora_config", None), engine_kwargs, own_fields)
    _accelerator(spec, entry.pop("accelerator_type", None), entry.pop("accelerator_config", None))
    _placement(spec, entry.pop("placement_group_config", None))
    _runtime_env(spec, entry.pop("runtime_env", None))
    _experimental(spec, entry.pop("experimental_configs", None) or {}, own_fields)
    if entry.pop("llm_engine", "vLLM") != "vLLM":
        raise LLMConfigError(f"{where}.llm_engine: only vLLM (the name Ray Serve LLM accepts; it means this engine)")
    if entry.pop("log_engine_metrics", True) is not True:
        raise LLMConfigError(f"{where}.log_engine_metrics: engine metrics are always exported here (/metrics)")
    for key in sorted(entry):
        reason = UNSUPPORTED_LLM_CONFIG_FIELDS.get(key, "not a field of Ray Serve LLM's LLMConfig")
        raise LLMConfigError(f"{where}.{key}: {reason}")
    return spec


def _set(spec: ModelSpec, field: str, value: Any, source: str) -> None:
    """field = value, unless another key of the same entry already set it to another value
    (an app-wide default may be overridden)."""
    previous = spec.sources.get(field)
    if previous is not None and field not in spec.defaulted and previous != source and spec.args[field] != value:
        raise LLMConfigError(f"{spec.where}.{source}: sets {field}, which {previous} already set otherwise; give one")
    spec.args[field] = value
    spec.sources[field] = source
    spec.defaulted.discard(field)


def _model_loading(spec: ModelSpec, loading: dict[str, Any]) -> None:
    loading = dict(loading)
    loading.pop("model_id")
    source = loading.pop("model_source", None)
    if source is None:
        source = spec.model_id  # Ray Serve LLM's default: the model id is the checkpoint's hub id
    if not isinstance(source, str) or source.startswith(CLOUD_PREFIXES):
        raise LLMConfigError(
            f"{spec.where}.model_loading_config.model_source: a local directory, a .gguf file, a built-in name "
            "(smollm2, tiny-opt, tiny-llama) or a hub id; cloud mirrors are not read here"
        )
    _set(spec, "model", source, "model_loading_config.model_source")
    tokenizer = loading.pop("tokenizer_source", None)
    if tokenizer is not None:
        _set(spec, "tokenizer", tokenizer, "model_loading_config.tokenizer_source")
    for key in sorted(loading):
        raise LLMConfigError(f"{spec.where}.model_loading_config.{key}: not a field of ModelLoadingConfig")


def _engine_kwargs(spec: ModelSpec, engine_kwargs: dict[str, Any], own_fields: frozenset[str]) -> None:
    for key, value in engine_kwargs.items():
        source = f"engine_kwargs.{key}"
        arg = ENGINE_KWARGS.get(key)
        if arg is None:
            if key in UNSUPPORTED_ENGINE_KWARGS:
                raise LLMConfigError(f"{spec.where}.{source}: not supported here: {UNSUPPORTED_ENGINE_KWARGS[key]}")
            if key not in OWN_ENGINE_FIELDS:
                raise LLMConfigError(
                    f"{spec.where}.{source}: not an engine option here, neither one of vLLM's this project maps nor "
                    "one of its own (docs/API.md, 'vLLM engine arguments', lists them)"
                )
            _set(spec, key, value, source)
            continue
        try:
            converted = arg.convert(value) if arg.convert is not None else value
        except ValueError as e:
            raise LLMConfigError(f"{spec.where}.{source}: {e}") from None
        if arg.field is not None:
            _set(spec, arg.field, converted, source)
    _check_engine_kwargs(spec, engine_kwargs)


def _check_engine_kwargs(spec: ModelSpec, engine_kwargs: dict[str, Any]) -> None:
    served = engine_kwargs.get("served_model_name")
    if served is not None and served not in (spec.model_id, [spec.model_id]):
        raise LLMConfigError(
            f"{spec.where}.engine_kwargs.served_model_name: the served name is model_loading_config.model_id "
            f"({spec.model_id!r}); give the same or leave it out"
        )
    auto = engine_kwargs.get("enable_auto_tool_choice")
    if auto is True and "tool_call_parser" not in spec.args:
        raise LLMConfigError(f"{spec.where}.engine_kwargs.enable_auto_tool_choice: needs tool_call_parser (hermes or llama3_json)")
    if auto is False and "tool_call_parser" in engine_kwargs:
        raise LLMConfigError(
            f"{spec.where}.engine_kwargs.enable_auto_tool_choice: false, but tool_call_parser is set (here tool_choice "
            "`auto` is parsed whenever a parser is set; leave tool_call_parser out to turn it off)"
        )


def _deployment_config(spec: ModelSpec, config: dict[str, Any]) -> None:
    if not isinstance(config, dict):
        raise LLMConfigError(f"{spec.where}.deployment_config: expected a mapping of Serve deployment options")
    if isinstance(config.get("num_replicas"), int) and config.get("autoscaling_config") is not None:
        raise LLMConfigError(
            f"{spec.where}.deployment_config.num_replicas: not with autoscaling_config (as Serve: give "
            "autoscaling_config.initial_replicas)"
        )
    options = dict(spec.args.get("deployment_options", {}))
    for key, value in config.items():
        source = f"deployment_config.{key}"
        if key == "name":
            if not isinstance(value, str) or not value:
                raise LLMConfigError(f"{spec.where}.{source}: expected a non-empty string")
            spec.deployment_name = value
        elif key == "num_replicas" and value == "auto":
            from ray.serve.config import AutoscalingConfig  # Serve's own defaults for "auto"

            auto = AutoscalingConfig.default().model_dump(exclude_unset=True)
            _set(spec, "autoscaling_config", auto | (config.get("autoscaling_config") or {}), source)
        elif key == "autoscaling_config" and config.get("num_replicas") == "auto":
            continue  # merged into Serve's "auto" defaults above
        elif key == "user_config":
            raise LLMConfigError(f"{spec.where}.{source}: LLMServer takes no user_config (it has no reconfigure)")
        elif key in DEPLOYMENT_FIELDS:
            _set(spec, key, value, source)
        else:
            options[key] = value  # Serve validates it (serve.deployment)
    if options:
        spec.args["deployment_options"] = options


def _lora_config(spec: ModelSpec, lora: Any, engine_kwargs: dict[str, Any], own_fields: frozenset[str]) -> None:
    if lora is None:
        return
    if not isinstance(lora, dict):
        raise LLMConfigError(f"{spec.where}.lora_config: expected a mapping")
    lora = dict(lora)
    _set(spec, "enable_lora", True, "lora_config")
    num = lora.pop("max_num_adapters_per_replica", 16)  # Ray Serve LLM's default
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise LLMConfigError(f"{spec.where}.lora_config.max_num_adapters_per_replica: expected a positive integer")
    source = "lora_config.max_num_adapters_per_replica"
    if "max_loras" not in engine_kwargs:
        _set(spec, "max_loras", num, source)
    if "max_cpu_loras" not in engine_kwargs:
        _set(spec, "max_cpu_loras", max(num, spec.args.get("max_loras", 1)), source)
    path = lora.pop("dynamic_lora_loading_path", None)
    if path is not None:
        _set(spec, "lora_modules", _adapters_under(spec.where, spec.model_id, path), "lora_config.dynamic_lora_loading_path")
        _set(spec, "lora_modules_root", path, "lora_config.dynamic_lora_loading_path")  # runtime loads too
    for key in sorted(lora):
        if key in ("download_timeout_s", "max_download_tries"):
            raise LLMConfigError(f"{spec.where}.lora_config.{key}: adapters are read from a local directory; nothing is downloaded")
        raise LLMConfigError(f"{spec.where}.lora_config.{key}: not a field of Ray Serve LLM's LoraConfig")


def _adapters_under(where: str, model_id: str, path: Any) -> dict[str, str]:
    """Each subdirectory of `path` holding an adapter_config.json, as `<model_id>:<name>`
    (Ray Serve LLM's adapter ids), in name order."""
    source = f"{where}.lora_config.dynamic_lora_loading_path"
    if not isinstance(path, str) or path.startswith(CLOUD_PREFIXES):
        raise LLMConfigError(f"{source}: a local directory of PEFT adapters (cloud storage is not read here)")
    root = Path(path)
    if not root.is_dir():
        raise LLMConfigError(f"{source}: {path!r} is not a directory")
    adapters = {}
    for child in sorted(root.iterdir()):
        if child.is_dir() and (child / "adapter_config.json").is_file():
            adapters[f"{model_id}:{child.name}"] = os.path.realpath(child)
    return adapters


def _accelerator(spec: ModelSpec, accelerator_type: Any, accelerator_config: Any) -> None:
    kind = None
    if accelerator_config is not None:
        if not isinstance(accelerator_config, dict) or set(accelerator_config) != {"kind"}:
            raise LLMConfigError(f"{spec.where}.accelerator_config: only {{kind: cpu}} or {{kind: gpu}} here")
        kind = accelerator_config["kind"]
        if kind not in ("cpu", "gpu"):
            raise LLMConfigError(f"{spec.where}.accelerator_config.kind: cpu or gpu here (got {kind!r})")
        _set(spec, "device", "cpu" if kind == "cpu" else "cuda", "accelerator_config.kind")
    if accelerator_type is None:
        return
    accelerator_type = "A10G" if accelerator_type == "A10" else accelerator_type  # as Ray Serve LLM
    if accelerator_type not in ray_accelerator_types():
        raise LLMConfigError(f"{spec.where}.accelerator_type: {accelerator_type!r} is not one of Ray's accelerator types")
    if kind == "cpu":
        raise LLMConfigError(f"{spec.where}.accelerator_type: cannot be used with accelerator_config kind cpu")
    if accelerator_type.startswith("TPU"):
        raise LLMConfigError(f"{spec.where}.accelerator_type: TPUs are not served here (CUDA GPUs or CPUs)")
    _set(spec, "accelerator_type", accelerator_type, "accelerator_type")
    device = spec.args.get("device", "auto")
    if device == "cpu":
        raise LLMConfigError(f"{spec.where}.accelerator_type: names a GPU, but {spec.sources['device']} says cpu")
    if device == "auto":
        _set(spec, "device", "cuda", "accelerator_type")


def ray_accelerator_types() -> frozenset[str]:
    """Ray's accelerator type names (ray.util.accelerators)."""
    from ray.util.accelerators import accelerators

    return frozenset(v for k, v in vars(accelerators).items() if k.isupper() and isinstance(v, str))


def _placement(spec: ModelSpec, config: Any) -> None:
    if config is None:
        return
    if not isinstance(config, dict):
        raise LLMConfigError(f"{spec.where}.placement_group_config: expected a mapping")
    config = dict(config)
    if "strategy" in config:
        _set(spec, "placement_group_strategy", config.pop("strategy"), "placement_group_config.strategy")
    per_worker = config.pop("bundle_per_worker", None)
    if per_worker is not None:
        source = "placement_group_config.bundle_per_worker"
        if not isinstance(per_worker, dict) or set(per_worker) - {"CPU", "GPU"}:
            raise LLMConfigError(f"{spec.where}.{source}: only CPU and GPU here (one bundle per TP rank)")
        if "CPU" in per_worker:
            _set(spec, "worker_cpus", per_worker["CPU"], source)
        gpus = per_worker.get("GPU")
        if gpus is not None and gpus not in (0, 1):
            raise LLMConfigError(f"{spec.where}.{source}.GPU: 0 or 1 (each TP rank has one device)")
        if gpus is not None and spec.args.get("device", "auto") == "auto":
            _set(spec, "device", "cuda" if gpus else "cpu", source)
    for key in sorted(config):
        raise LLMConfigError(
            f"{spec.where}.placement_group_config.{key}: the bundles here are one for the replica, then one per TP rank; "
            "give strategy and bundle_per_worker (or experimental_configs.worker_cpus / scheduler_cpus)"
        )


def _runtime_env(spec: ModelSpec, runtime_env: Any) -> None:
    if runtime_env is None:
        return
    options = dict(spec.args.get("ray_actor_options", {"num_cpus": 0.1}))
    if "runtime_env" in options:
        raise LLMConfigError(f"{spec.where}.runtime_env: deployment_config.ray_actor_options.runtime_env is set too; give one")
    options["runtime_env"] = runtime_env
    spec.args["ray_actor_options"] = options  # deployment_config's options, plus the environment


def _experimental(spec: ModelSpec, config: dict[str, Any], own_fields: frozenset[str]) -> None:
    if not isinstance(config, dict):
        raise LLMConfigError(f"{spec.where}.experimental_configs: expected a mapping")
    for key, value in config.items():
        source = f"experimental_configs.{key}"
        if key == "num_ingress_replicas":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LLMConfigError(f"{spec.where}.{source}: expected a positive integer")
            spec.num_ingress_replicas = value
        elif key in APP_WIDE_FIELDS:
            raise LLMConfigError(f"{spec.where}.{source}: an application-wide option: give it next to llm_configs")
        elif key in own_fields:
            _set(spec, key, value, source)
        else:
            raise LLMConfigError(
                f"{spec.where}.{source}: not an option here (stream_batching_interval_ms, num_ingress_replicas, or an "
                "AppArgs field)"
            )


def _ingress_options(ingress: dict[str, Any], models: list[ModelSpec]) -> dict[str, Any]:
    """Ray Serve LLM's ingress_deployment_config as AppArgs' ingress_* fields (set on every
    model's spec) and the remaining serve.deployment options of the ingress."""
    ingress = dict(ingress)
    fields: dict[str, Any] = {}
    replicas = [m.num_ingress_replicas for m in models if m.num_ingress_replicas is not None]
    if replicas:
        fields["ingress_replicas"] = max(replicas)  # as Ray Serve LLM: the largest any model asks for
    if "num_replicas" in ingress:
        fields["ingress_replicas"] = ingress.pop("num_replicas")
    if "max_ongoing_requests" in ingress:
        fields["ingress_max_ongoing_requests"] = ingress.pop("max_ongoing_requests")
    actor = dict(ingress.pop("ray_actor_options", {}))
    if "num_cpus" in actor:
        fields["ingress_cpus"] = actor.pop("num_cpus")
    if actor:
        ingress["ray_actor_options"] = actor
    if "name" in ingress:
        raise LLMConfigError("ingress_deployment_config.name: the ingress deployment is OpenAIIngress")
    for spec in models:
        for key, value in fields.items():
            spec.args[key] = value
            spec.sources[key] = f"ingress_deployment_config ({key})"
    return ingress


def error_source(spec: ModelSpec, field: str) -> str:
    """The key of the entry that set AppArgs field `field` (for a validation error)."""
    source = spec.sources.get(field, field)
    return source if source.split(".")[-1] == field else f"{source} ({field} here)"


def mapping_table() -> str:
    """The engine_kwargs mapping as the markdown table docs/API.md and docs/DEPLOY.md carry."""
    rows = ["| vLLM engine argument | here | notes |", "| --- | --- | --- |"]
    for name, arg in ENGINE_KWARGS.items():
        rows.append(f"| `{name}` | {f'`{arg.field}`' if arg.field else '(checked)'} | {arg.note} |")
    for name, reason in UNSUPPORTED_ENGINE_KWARGS.items():
        rows.append(f"| `{name}` | start-up error | {reason} |")
    return "\n".join(rows)


def llm_config_table() -> str:
    """LLMConfig's fields as the markdown table docs/DEPLOY.md carries."""
    rows = ["| LLMConfig field | here |", "| --- | --- |"]
    rows += [f"| `{name}` | {where} |" for name, where in LLM_CONFIG_FIELDS.items()]
    rows += [f"| `{name}` | start-up error: {why} |" for name, why in UNSUPPORTED_LLM_CONFIG_FIELDS.items()]
    return "\n".join(rows)
