"""The Serve application: `import_path: rayserve_paged.app:build_app`.

    HTTP (Serve proxy) ──> LLMServer replica ──> SchedulerActor ──> Worker actors
    DeploymentHandle   ──>  (FastAPI app,          (bundle 0)         (bundles 1..TP)
                             bundle 0)

`build_app(args)` validates AppArgs once (an invalid field fails here, named) and binds the
undecorated LLMServer class, made a late-bound Serve ingress here (`serve.ingress()`): the
OpenAI app runs in the replica that owns the engine, so HTTP reaches it in one hop, and the
Python handle API is on the same deployment. Each replica gets a placement group of its
own, so an autoscaled replica always brings its own workers.

`routing: prefix` (fleets) puts the OpenAI app in an OpenAIIngress deployment instead,
which calls RoutedLLMServer by handle through PrefixAffinityRouter (deployments/routing.py):

    HTTP (Serve proxy) ──> OpenAIIngress ──(PrefixAffinityRouter)──> RoutedLLMServer ──> ...

`build_openai_app(args)` (`import_path: rayserve_paged.app:build_openai_app`) takes Ray Serve
LLM's `llm_configs` (serve_llm.py maps each entry onto AppArgs): one LLMServer deployment per
model, behind one OpenAI ingress routing by `model` (deployments/multi_model.py); a single
model under `routing: load` is served in one hop, as build_app does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from rayserve_paged.config import EngineConfig
from rayserve_paged.deployments.access import API_KEY_ENV, API_KEY_FILE_ENV, API_KEY_REFUSED, DEFAULT_OPEN_PATHS
from rayserve_paged.deployments.serving.response_store import ResponseStoreConfig
from rayserve_paged.engine.frontend import STREAM_BATCHING_INTERVAL_MS
from rayserve_paged.serve_llm import LLMConfigError, ModelSpec, error_source, is_llm_configs, translate
from rayserve_paged.telemetry import TelemetryConfig


class AppArgs(EngineConfig):
    """Engine options (EngineConfig's fields) plus how Serve runs the deployments."""

    # an error never echoes what was given: Serve args may carry secrets (see api_key below)
    model_config = ConfigDict(**EngineConfig.model_config, hide_input_in_errors=True)

    served_model_name: str | None = Field(None, description="Model name in the API; defaults to `model`.")
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = Field(
        None,
        description="Reads tool calls out of tool_choice 'auto' outputs (as vllm serve --enable-auto-tool-choice "
        "--tool-call-parser); without it, tool_choice 'auto' is a 400.",
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None,
        description="Moves a thinking model's <think>...</think> text into reasoning_content, and starts a "
        "request's constraint after it (as vllm serve --reasoning-parser).",
    )
    chat_template: str | None = Field(
        None,
        min_length=1,
        description="A Jinja chat template in place of the tokenizer's: the template's text, or the path of a "
        "file holding it, read when the app is built (vLLM's --chat-template).",
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; behind the API "
        "key; as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING). Each call changes the replica that answers it only. "
        "Not with routing: prefix.",
    )
    responses_store: ResponseStoreConfig = Field(
        default_factory=ResponseStoreConfig,
        description="Bounds of the stored responses of /v1/responses (previous_response_id, GET "
        "/v1/responses/{id}), kept in memory by each process that serves HTTP: each LLMServer replica "
        "(routing: load) or each OpenAIIngress replica (routing: prefix). docs/API.md, Responses.",
    )
    unauthenticated_paths: list[str] = Field(
        default_factory=lambda: list(DEFAULT_OPEN_PATHS),
        description=f"Routes that need no API key when {API_KEY_ENV} is set (as vLLM protects only /v1).",
    )
    require_api_key: bool = Field(
        False,
        description=f"A replica that finds no API key ({API_KEY_ENV} or {API_KEY_FILE_ENV}) in its environment "
        "refuses to start. Off: no key serves every route to anyone who reaches the port, with one WARNING at "
        "start-up. A key variable set but blank always refuses to start.",
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Serve autoscaling for LLMServer (min_replicas, max_replicas, target_ongoing_requests ...)."
    )
    autoscaling_policy: Literal["kv", "requests"] = Field(
        "requests",
        description="With autoscaling_config: `kv` scales on KV-cache pressure (and request counts), "
        "`requests` on ongoing requests only (Serve's default policy).",
    )
    target_kv_usage: float = Field(
        0.85, gt=0, le=1, description="kv policy: scale up while the mean GPU KV usage stays above this."
    )
    scale_down_kv_usage: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="kv policy: scale down while the mean GPU KV usage stays below this and nothing waits "
        "(default target_kv_usage / 2).",
    )
    graceful_shutdown_timeout_s: float = Field(
        300.0,
        ge=0,
        description="A replica being removed (downscale, update) stops taking requests and gets this long "
        "to finish its streams before it is killed (Serve's default is 20 s).",
    )
    graceful_shutdown_wait_loop_s: float = Field(
        2.0, gt=0, description="How often a stopping replica checks whether its requests are done."
    )
    deployment_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other `serve.deployment` option for LLMServer (e.g. health_check_period_s, "
        "logging_config, request_router_config), passed through and validated by Serve.",
    )
    num_replicas: int = Field(1, ge=1, description="Fixed LLMServer replicas when autoscaling_config is unset.")
    max_ongoing_requests: int = Field(
        2048,
        ge=1,
        description="Requests Serve sends each LLMServer replica at once (Serve's option). Keep it >= "
        "max_pending_requests, so that this replica's admission, not Serve, decides what waits and what is shed.",
    )
    max_queued_requests: int = Field(
        -1,
        ge=-1,
        description=(
            "Requests each caller (Serve's proxy, or an ingress replica) queues for LLMServer beyond "
            "max_ongoing_requests. -1 (the default, and the shipped configs'): no limit, so Serve never answers "
            "first; >= 0: past it Serve's proxy answers its own 503 (a text body, no Retry-After) under "
            "routing: load, and routing: prefix's ingress turns Serve's refusal into the OpenAI 503 + Retry-After."
        ),
    )
    ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 0.1}, description="Options of the LLMServer replica actor."
    )
    scheduler_cpus: float = Field(
        0.1, ge=0, description="CPUs of the SchedulerActor (bundle 0 at TP > 1; added to rank 0's bundle at TP = 1)."
    )
    worker_cpus: float = Field(
        1.0, gt=0, description="CPUs of each tensor-parallel rank (a Worker actor; at TP = 1 rank 0 in the SchedulerActor)."
    )
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="How a replica's bundles are placed."
    )
    accelerator_type: str | None = Field(
        None,
        min_length=1,
        description="A GPU type (Ray's names: A10G, L4, H100, ...): each GPU bundle also asks for Ray's "
        "`accelerator_type:<type>` resource, so replicas land on nodes of that type (as Ray Serve LLM).",
    )
    routing: Literal["load", "prefix"] = Field(
        "load",
        description="How requests reach LLMServer replicas. `load`: the HTTP app runs in the replicas and Serve "
        "routes by queue length (one hop; the choice for one replica). `prefix`: an OpenAIIngress deployment "
        "parses and tokenizes each request and sends it to its session's replica (x-session-id header or "
        "`user`), else (naming a LoRA adapter) to a replica holding the adapter in a device slot, else to the "
        "replica whose prefix cache holds the longest chain of its first blocks; to the "
        "shortest queue instead when that replica's queue is longer than the shortest by more than "
        "routing_imbalance_threshold (one more hop; docs/DEPLOY.md).",
    )
    routing_imbalance_threshold: float = Field(
        8,
        ge=0,
        allow_inf_nan=False,
        description="routing: prefix: a request's session replica, or the replica holding its prefix, is "
        "passed over when its queue is longer than the shortest queue by more than this many requests.",
    )
    routing_stats_period_s: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="routing: prefix: how often each replica reports the keys its prefix cache holds "
        "(Serve's request_routing_stats_period_s).",
    )
    ingress_cpus: float = Field(
        0.1, ge=0, description="routing: prefix: CPUs of each OpenAIIngress replica (ignored with `load`)."
    )
    ingress_replicas: int = Field(
        1,
        ge=1,
        description="routing: prefix: OpenAIIngress replicas (ignored with `load`). Each keeps its own session "
        "map, so a session may start on different replicas through different ingress replicas.",
    )
    ingress_max_ongoing_requests: int = Field(
        1024, ge=1, description="routing: prefix: requests in flight per OpenAIIngress replica (ignored with `load`)."
    )
    max_pending_requests: int = Field(
        2048,
        ge=1,
        description=(
            "Completion, chat, /tokenize and /detokenize requests in flight per LLMServer replica (a memory "
            "bound, before a body is read); more are answered 503 + Retry-After at once. "
            "Keep it <= max_ongoing_requests, or Serve queues the excess before it gets here."
        ),
    )
    max_queue_wait_s: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="A tokenized completion or chat request is queued unless this replica estimates it would "
        "wait longer than this (the work ahead of it, at least as urgent under scheduling_policy: priority, "
        "over the work per second the replica has been measured to drain); then it is answered 503 + "
        "Retry-After (the excess of the estimate) at once. Nothing is shed by time before the first measurement.",
    )
    max_queued_prompt_tokens: int = Field(
        1 << 20,
        ge=1,
        description="Prompt tokens of the requests in flight per LLMServer replica; one that would pass it is "
        "answered 503 + Retry-After (a request finding none queued always goes).",
    )
    max_pending_sequences: int = Field(
        4096,
        ge=1,
        description=(
            "Sequences in flight per LLMServer replica: each admitted completion or chat request takes "
            "prompts x best_of (n when best_of is unset; the beam width with use_beam_search). A request "
            "that does not fit while others run is answered 503 + Retry-After; one larger than the whole "
            "budget, 400."
        ),
    )
    max_tokenizer_queue_bytes: int = Field(
        8 << 20,
        ge=1,
        description="Bytes of request bodies whose tokenizer jobs (prompts, chat templates, /tokenize, "
        "/detokenize) are queued or running per LLMServer replica; a job that would pass it is answered 503 + "
        "Retry-After (one finding the queue empty always runs).",
    )
    request_body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request whose body's reads have waited this long in all without its last byte is "
        "answered 408 and its admission slot freed (a client that sends half a body and stalls holds nothing); "
        "time the replica takes before reading the body does not count.",
    )
    enable_prompt_tokens_details: bool = Field(
        False,
        description="Report usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details). "
        "Off by default: the count tells a client whether another client already sent the same prefix; turn it "
        "on when every client is trusted, or when each tenant sends its own cache_salt.",
    )
    metrics_cache_s: float = Field(
        2.0,
        ge=0,
        description="GET /metrics (open by default) serves the fleet's merged metrics at most this old: each "
        "replica lists the fleet's scheduler actors and calls them once per interval, however often it is "
        "scraped. 0 fetches on every scrape.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Streamed responses (SSE, and the handle API's generate_stream) send an event once a choice "
        "has this many new tokens (the first token, a finish and an error at once): 1 sends every engine "
        "step; larger values send fewer, larger events, cutting per-event serving overhead under load at "
        "the cost of smoothness (vLLM's --stream-interval).",
    )
    stream_batching_interval_ms: float = Field(
        STREAM_BATCHING_INTERVAL_MS,
        ge=0,
        allow_inf_nan=False,
        description="Streamed responses send a stream's new tokens on a schedule of one event per this many "
        "milliseconds, each due one interval after the previous one was due (the first token, a finish and an "
        "error at once), so the events per stream stay bounded whatever the engine's step rate; 0 sends as "
        "stream_interval says (Ray Serve LLM's stream_batching_interval_ms).",
    )
    max_request_body_bytes: int = Field(
        1 << 20, ge=1, description="Largest HTTP request body; a larger one is answered 413 before it is parsed."
    )
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig, description="Metrics export (Prometheus port, OTLP interval)."
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_api_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError(API_KEY_REFUSED)
        return data

    @model_validator(mode="after")
    def _check_lora_names(self) -> AppArgs:
        served = self.served_model_name or self.model
        if served in self.lora_modules:
            raise ValueError(f"lora_modules: adapter name {served!r} is the served model's name")
        return self

    @model_validator(mode="after")
    def _check_fleet_options(self) -> AppArgs:
        if self.scale_down_kv_usage is not None and self.scale_down_kv_usage >= self.target_kv_usage:
            raise ValueError(
                f"scale_down_kv_usage ({self.scale_down_kv_usage}) must be below target_kv_usage "
                f"({self.target_kv_usage})"
            )
        if self.autoscaling_policy == "kv" and "policy" in (self.autoscaling_config or {}):
            raise ValueError(
                "autoscaling_config.policy: give either autoscaling_policy: kv or a policy of your own, not both"
            )
        if self.routing == "prefix" and self.allow_runtime_lora_updating:
            raise ValueError(
                "allow_runtime_lora_updating: routing: prefix serves the adapters of lora_modules only (a runtime "
                "load would change one replica, and the router keys each adapter by its start-up id)"
            )
        if self.routing == "prefix" and "request_router_config" in self.deployment_options:
            raise ValueError(
                "deployment_options.request_router_config: routing: prefix sets LLMServer's request router; "
                "use routing: load with a router of your own"
            )
        named = sorted(set(self.deployment_options) & (LLM_SERVER_OPTIONS_NAMED | {"name"}))
        if named:
            raise ValueError(
                f"deployment_options.{named[0]}: set by AppArgs; use the AppArgs field of that name "
                "(or placement_group_strategy / worker_cpus / scheduler_cpus for placement)"
            )
        return self


def uses_gpu(args: EngineConfig) -> bool:
    if args.device != "auto":
        return args.device == "cuda"
    import ray

    if ray.is_initialized():
        return bool(ray.cluster_resources().get("GPU", 0))
    import torch

    return torch.cuda.is_available()


def placement_group_bundles(args: AppArgs) -> list[dict[str, float]]:
    """Bundle 0: the replica (and its SchedulerActor at TP > 1); then one bundle per TP rank
    (at TP = 1 the SchedulerActor hosting rank 0)."""
    from rayserve_paged.engine.ray_executor import replica_bundles

    replica_cpus = float(args.ray_actor_options.get("num_cpus", 1.0))
    bundles = replica_bundles(args, replica_cpus, args.scheduler_cpus, args.worker_cpus, uses_gpu(args))
    if args.accelerator_type is not None:  # Ray's node resource for the type, 0.001 per GPU bundle
        bundles = [b | {f"accelerator_type:{args.accelerator_type}": 0.001} if b.get("GPU") else b for b in bundles]
    return bundles


def engine_config_of(args: AppArgs) -> EngineConfig:
    return EngineConfig(**args.model_dump(include=set(EngineConfig.model_fields)))


# serve.deployment options that AppArgs sets from fields of its own
LLM_SERVER_OPTIONS_NAMED = frozenset(
    {
        "max_ongoing_requests",
        "max_queued_requests",
        "ray_actor_options",
        "placement_group_bundles",
        "placement_group_strategy",
        "autoscaling_config",
        "num_replicas",
        "graceful_shutdown_timeout_s",
        "graceful_shutdown_wait_loop_s",
    }
)


def autoscaling_config_of(args: AppArgs) -> dict[str, Any] | None:
    """Serve's autoscaling_config for LLMServer; with `kv`, the KV-pressure policy in it."""
    if args.autoscaling_config is None:
        return None
    config = dict(args.autoscaling_config)
    if args.autoscaling_policy == "kv":
        from rayserve_paged.deployments.autoscaling import POLICY_PATH

        kwargs: dict[str, Any] = {"target_kv_usage": args.target_kv_usage}
        if args.scale_down_kv_usage is not None:
            kwargs["scale_down_kv_usage"] = args.scale_down_kv_usage
        config["policy"] = {"policy_function": POLICY_PATH, "policy_kwargs": kwargs}
    return config


def llm_server_options(args: AppArgs) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": "LLMServer",
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "ray_actor_options": dict(args.ray_actor_options),
        "placement_group_bundles": placement_group_bundles(args),
        "placement_group_strategy": args.placement_group_strategy,
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": args.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": args.graceful_shutdown_wait_loop_s,
    }
    autoscaling = autoscaling_config_of(args)
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = args.num_replicas
    options.update(args.deployment_options)  # Serve validates them (serve.deployment below)
    return options


def http_options_of(args: AppArgs) -> dict[str, Any]:
    """create_openai_app's options (no API key here: the replicas read it from their
    environment, deployments/access.py)."""
    return {
        "served_model_name": args.served_model_name or args.model,
        "max_request_body_bytes": args.max_request_body_bytes,
        "max_pending_requests": args.max_pending_requests,
        "max_pending_sequences": args.max_pending_sequences,
        "max_tokenizer_queue_bytes": args.max_tokenizer_queue_bytes,
        "max_queue_wait_s": args.max_queue_wait_s,
        "max_queued_prompt_tokens": args.max_queued_prompt_tokens,
        "scheduling_policy": args.scheduling_policy,
        "request_body_timeout_s": args.request_body_timeout_s,
        "open_paths": tuple(args.unauthenticated_paths),
        "require_api_key": args.require_api_key,
        "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "allow_runtime_lora_updating": args.allow_runtime_lora_updating,
        "chat_template": chat_template_of(args.chat_template),
        "responses_store": args.responses_store.model_dump(),
    }


def chat_template_of(value: str | None) -> str | None:
    """The template's text: the file `value` names, else `value` itself when it reads as a
    template (as vLLM resolves --chat-template). Read here, at build time, never in a replica."""
    if value is None:
        return None
    from pathlib import Path

    try:
        return Path(value).read_text()
    except (OSError, ValueError):
        if any(c in value for c in "{}\n"):
            return value
        raise ValueError(f"chat_template: {value!r} is neither a readable file nor a Jinja template") from None


def server_kwargs_of(args: AppArgs) -> dict[str, Any]:
    """LLMServer's constructor options besides the engine config."""
    return {
        "scheduler_cpus": args.scheduler_cpus,
        "worker_cpus": args.worker_cpus,
        "telemetry": args.telemetry.model_dump(),
        "stream_interval": args.stream_interval,
        "stream_batching_interval_ms": args.stream_batching_interval_ms,
        "metrics_cache_s": args.metrics_cache_s,
    }


def build_app(args: AppArgs | dict):
    """Serve application builder (also what `serve run configs/*.yaml` calls)."""
    from ray import serve

    from rayserve_paged.deployments.llm_server import LLMServer

    if is_llm_configs(args):  # Ray Serve LLM's shape under this import path too
        return build_openai_app(args)
    if not isinstance(args, AppArgs):
        if "api_key" in args:  # before anything could echo it
            raise ValueError(API_KEY_REFUSED)
        args = AppArgs(**args)
    engine = engine_config_of(args)
    http = http_options_of(args)
    server_kwargs = server_kwargs_of(args)
    if args.routing == "prefix":
        return _prefix_routed_app(args, engine, server_kwargs, http)
    try:
        llm = serve.deployment(serve.ingress()(LLMServer), **llm_server_options(args))
    except TypeError as e:  # an option serve.deployment does not know (its own values raise ValidationError)
        raise ValueError(f"deployment_options: {e}") from e
    return llm.bind(engine.model_dump(), http=http, **server_kwargs)


SENT_GENERATION_MIN_S = 5.0


def router_config_of(args: AppArgs) -> dict[str, Any]:
    """LLMServer's request_router_config under routing: prefix."""
    from rayserve_paged.deployments.routing import ROUTER_PATH

    return {
        "request_router_class": ROUTER_PATH,
        "request_router_kwargs": {
            "imbalance_threshold": args.routing_imbalance_threshold,
            # a sent key lives two generations: past the next report even when one is late
            "sent_generation_s": max(SENT_GENERATION_MIN_S, 4 * args.routing_stats_period_s),
        },
        "request_routing_stats_period_s": args.routing_stats_period_s,
        "request_routing_stats_timeout_s": max(5.0, 2 * args.routing_stats_period_s),
    }


def _prefix_routed_app(args: AppArgs, engine: EngineConfig, server_kwargs: dict[str, Any], http: dict[str, Any]):
    """OpenAIIngress (the HTTP app, parsing and tokenizing) over RoutedLLMServer replicas
    behind PrefixAffinityRouter (deployments/routing.py)."""
    from ray import serve

    from rayserve_paged.deployments.ingress import OpenAIIngress
    from rayserve_paged.deployments.llm_server import RoutedLLMServer

    options = llm_server_options(args) | {"request_router_config": router_config_of(args)}
    try:
        llm = serve.deployment(RoutedLLMServer, **options)
    except TypeError as e:
        raise ValueError(f"deployment_options: {e}") from e
    ingress = serve.deployment(
        serve.ingress()(OpenAIIngress),
        name="OpenAIIngress",
        num_replicas=args.ingress_replicas,
        max_ongoing_requests=args.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": args.ingress_cpus},
    )
    return ingress.bind(
        llm.bind(engine.model_dump(), **server_kwargs),
        tokenizer=args.tokenizer or args.model,
        block_size=args.block_size,
        http=http,
        trust_remote_code=args.trust_remote_code,
        metrics_cache_s=args.metrics_cache_s,
        lora_modules=dict(args.lora_modules),
    )


def build_openai_app(args: dict):
    """Serve application builder for Ray Serve LLM's args (`import_path:
    rayserve_paged.app:build_openai_app`, `args: {llm_configs: [...]}`; serve_llm.py maps
    each LLMConfig onto AppArgs). One model under `routing: load` is served in one hop, as
    build_app serves it; otherwise every model's LLMServer deployment sits behind one
    OpenAI ingress that routes by `model` (deployments/multi_model.py)."""
    from ray import serve

    from rayserve_paged.deployments.llm_server import LLMServer

    spec = translate(args, frozenset(AppArgs.model_fields))
    models = [(model, model_args_of(model)) for model in spec.models]
    (first, first_args), many = models[0], len(models) > 1
    if not many and first_args.routing == "load" and not spec.ingress_options:
        options = llm_server_options(first_args) | {"name": first.deployment_name}
        llm = _deployment(serve.ingress()(LLMServer), options)
        return llm.bind(engine_config_of(first_args).model_dump(), http=http_options_of(first_args),
                        **server_kwargs_of(first_args))  # fmt: skip
    return _multi_model_app(models, spec.ingress_options)


def model_args_of(model: ModelSpec) -> AppArgs:
    """A model's AppArgs; an invalid value is an error naming the llm_configs key that set it."""
    from pydantic import ValidationError

    try:
        args = AppArgs(**(model.args | {"served_model_name": model.model_id}))
    except ValidationError as e:
        problems = []
        for error in e.errors():
            loc = [str(part) for part in error["loc"]]
            where = error_source(model, loc[0]) + "".join(f".{part}" for part in loc[1:]) if loc else "config"
            problems.append(f"{where}: {error['msg']}")
        raise LLMConfigError(f"{model.where}: {'; '.join(problems)}") from None
    if args.allow_runtime_lora_updating:
        raise LLMConfigError(
            f"{model.where}: allow_runtime_lora_updating: adapters come from "
            "lora_config.dynamic_lora_loading_path (read at start-up) in this form"
        )
    return args


def _deployment(cls, options: dict[str, Any]):
    from ray import serve

    try:
        return serve.deployment(cls, **options)
    except TypeError as e:  # an option serve.deployment does not know (its own values raise ValidationError)
        raise ValueError(f"deployment_options: {e}") from e


def _multi_model_app(models: list[tuple[ModelSpec, AppArgs]], ingress_options: dict[str, Any]):
    """One OpenAIIngress (deployments/multi_model.py) over one LLMServer deployment per model,
    each with its own options (autoscaling, placement, routing)."""
    from ray import serve

    from rayserve_paged.deployments.llm_server import RoutedLLMServer
    from rayserve_paged.deployments.multi_model import ModelServer, MultiModelIngress

    served = []
    for model, args in models:
        options = llm_server_options(args) | {"name": model.deployment_name}
        if args.routing == "prefix":
            options["request_router_config"] = router_config_of(args)
        llm = _deployment(RoutedLLMServer if args.routing == "prefix" else ModelServer, options)
        served.append({
            "model_id": model.model_id,
            "deployment_name": model.deployment_name,
            "handle": llm.bind(engine_config_of(args).model_dump(), **server_kwargs_of(args)),
            "tokenizer": args.tokenizer or args.model,
            "trust_remote_code": args.trust_remote_code,
            "block_size": args.block_size,
            "lora_modules": dict(args.lora_modules),
            "http": http_options_of(args),
        })  # fmt: skip
    app_args = models[0][1]  # the application-wide fields are the same in every model's
    options = dict(ingress_options)
    options["ray_actor_options"] = {"num_cpus": app_args.ingress_cpus} | options.get("ray_actor_options", {})
    if "autoscaling_config" not in options:
        options["num_replicas"] = app_args.ingress_replicas
    options.setdefault("max_ongoing_requests", app_args.ingress_max_ongoing_requests)
    ingress = _deployment(serve.ingress()(MultiModelIngress), {"name": "OpenAIIngress"} | options)
    return ingress.bind(served, metrics_cache_s=app_args.metrics_cache_s)
