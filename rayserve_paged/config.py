"""User-facing engine configuration: pydantic, validated once, no I/O.

Errors name the field (pydantic's ValidationError lists each bad field with its reason).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_CPU_KV_CACHE_GB = 1.0
DEFAULT_MAX_CPU_LORAS = 8  # adapters registered at once, unless max_cpu_loras says


class SpeculativeDecodingConfig(BaseModel):
    """Speculative decoding (vLLM's speculative_config): drafts verified in one step, from
    the sequence's own prompt and output (ngram) or from a small model of the same
    tokenizer run by the same worker (draft_model, at tensor_parallel_size 1)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: Literal["ngram", "draft_model"] = Field(
        "ngram", description="ngram (prompt lookup) or draft_model (a small model of the same tokenizer: `model`)."
    )
    model: str | None = Field(
        None,
        description="The draft model (method draft_model): any name or path the loader serves (a local HF "
        "directory, a .gguf file, a built-in name, a hub id); its vocabulary must be the target's.",
    )
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="Most drafts per sequence and step.")
    prompt_lookup_min: int = Field(1, ge=1, description="Shortest suffix n-gram looked up (ngram).")
    prompt_lookup_max: int = Field(
        4, ge=1, le=64, description="Longest suffix n-gram looked up, tried first (ngram)."
    )
    disable_by_batch_size: int = Field(
        32, ge=1, description="No drafts in a step whose running batch holds at least this many sequences "
        "(32: measured, docs/benchmarks/27-speculative.md)."
    )
    min_accepted_per_step: float = Field(
        1.0, ge=0.0, description="A sequence whose last 4 verification steps kept fewer drafts than this on "
        "average drafts no more for 16 decode steps (doubling, up to 256, while it stays low); 0: never paused."
    )

    @field_validator("method", mode="before")
    @classmethod
    def _known_method(cls, value):
        if value in ("eagle", "eagle3", "mtp", "medusa", "suffix"):
            raise ValueError(f"method {value!r} is not supported here: only 'ngram' (prompt lookup) and 'draft_model'")
        return value

    @model_validator(mode="after")
    def _check_lookup(self) -> SpeculativeDecodingConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("method 'draft_model' needs `model`: the draft model's name or path")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"`model` ({self.model!r}) is for method 'draft_model'; method 'ngram' takes none")
        return self


class EngineConfig(BaseModel):
    """Everything one engine (one Serve replica, or one offline `LLM`) needs."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    model: str = Field(
        "tiny-opt",
        description="smollm2 (embedded GGUF), tiny-opt / tiny-llama, a local HF directory, a .gguf file, or a hub id.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer path or id; defaults to the model's.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights and KV dtype; auto = float32 on CPU, the checkpoint's dtype on GPU."
    )
    quantization: Literal["auto", "none", "gguf", "awq", "gptq", "fp8"] = Field(
        "auto",
        description="Weight format: auto keeps what the checkpoint quantized where a kernel serves it (GGUF "
        "Q4_0/Q4_1/Q8_0, AWQ/GPTQ int4, FP8 e4m3 with torch's FP8 GEMM on CUDA sm_89+; other GGUF types are "
        "dequantized); none dequantizes every weight into dtype at load; gguf/awq/gptq/fp8 = auto, checking the "
        "checkpoint is of that kind.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available.")
    tensor_parallel_size: int = Field(1, ge=1, description="Tensor-parallel ranks (worker actors).")
    block_size: Literal[8, 16, 32] = Field(16, description="Tokens per KV block.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of GPU memory for weights, activations and KV cache."
    )
    kv_cache_memory_gb: float | None = Field(
        None, gt=0, description=f"KV cache size in GiB (CPU default {DEFAULT_CPU_KV_CACHE_GB})."
    )
    num_gpu_blocks_override: int | None = Field(None, ge=1, description="Exact number of KV blocks.")
    swap_space_gb: float = Field(4.0, ge=0, description="CPU swap pool in GiB (per TP rank).")
    kv_offload_memory_gb: float = Field(
        0.0,
        ge=0,
        description="Tier 2 of the prefix cache, in GiB of host memory per TP rank (0: off): prefix blocks "
        "evicted from the KV cache are copied there and copied back on a hit instead of recomputed. It joins "
        "the swap pool (one CPU pool of swap_space_gb + kv_offload_memory_gb); a swap-out takes precedence "
        "over a tier-2 entry. Needs enable_prefix_caching.",
    )
    preemption_mode: Literal["recompute", "swap", "auto"] = Field(
        "auto", description="recompute, swap, or auto (recompute single sequences, swap groups)."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    watermark: float = Field(0.01, ge=0, lt=1, description="Share of KV blocks kept free at admission.")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one step.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="fcfs: requests are admitted in arrival order and the latest is preempted first; priority: "
        "by each request's `priority` (lower is more urgent), then arrival: the most urgent is admitted first "
        "and the least urgent, latest is preempted first (vLLM's --scheduling-policy).",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="Most tokens in one step (decodes and prefill chunks); defaults to 2048 with chunked "
        "prefill, else max(max_model_len, 2048).",
    )
    enable_chunked_prefill: bool = Field(
        True,
        description="Split long prompts into chunks that share each step's token budget with the running "
        "decodes (decodes first, then prompt chunks in arrival order).",
    )
    max_model_len: int | None = Field(None, ge=1, description="Longest sequence; defaults to the model's.")
    attention_backend: Literal["auto", "torch", "triton", "flash"] = Field(
        "auto", description="auto = triton on CUDA, torch on CPU."
    )
    enforce_eager: bool = Field(
        False,
        description="Run every step eagerly on its exact batch: no CUDA graphs and no padded static-shape "
        "decode path (vLLM's name). Off: decode-only steps run padded to a bucket size, replaying one CUDA "
        "graph per bucket on CUDA with the triton backend.",
    )
    seed: int = Field(0, description="Seed for unseeded sampling and random weights.")
    max_logprobs: int = Field(20, ge=0, description="Largest logprobs a request may ask for.")
    task: Literal["generate", "embed"] = Field(
        "generate",
        description="What the served model answers (vLLM's name): generate (completions, chat, responses) or embed "
        "(/v1/embeddings, /v1/score, /v1/rerank, pooling the final hidden states); the other task's routes answer 400.",
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off by default).")
    num_cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads in a CPU worker (default: OMP_NUM_THREADS, which Ray sets to the "
        "worker actor's num_cpus, else the CPUs the process may run on).",
    )
    worker_transport: Literal["compiled_graph", "actor_calls"] = Field(
        "compiled_graph",
        description=(
            "How the scheduler actor drives worker actors (tensor_parallel_size > 1): a Ray Compiled Graph "
            "compiled once at start-up (shared-memory channels), or one actor call per rank per step."
        ),
    )

    speculative_config: SpeculativeDecodingConfig | None = Field(
        None,
        description="Speculative decoding (vLLM's shape): {method: ngram | draft_model, model (draft_model), "
        "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, disable_by_batch_size}; null: off.",
    )

    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters (PEFT format) over the base model, many per batch (implied by lora_modules).",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters to register at start-up: name (what a request's `model` says) -> PEFT directory.",
    )
    max_loras: int = Field(1, ge=1, description="Adapters resident on the device at once (slots in every layer).")
    max_lora_rank: int = Field(16, ge=1, le=64, description="Largest adapter rank r; the slots are this wide.")
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="Adapters registered at once: each is read once, at registration, and its tensors stay in CPU "
        "memory until it is unloaded; a load past the bound is refused (default: max(max_loras, the number of "
        f"lora_modules, {DEFAULT_MAX_CPU_LORAS})).",
    )
    max_cpu_lora_memory_gb: float = Field(
        2.0, gt=0, description="CPU memory the registered adapters' tensors may take in all (float32 A and B); a "
        "load past it is refused.",
    )  # fmt: skip
    max_lora_size_mb: float = Field(
        1024.0, gt=0, description="Largest adapter_model.safetensors a load accepts."
    )
    lora_modules_root: list[str] = Field(
        default_factory=list,
        description="Directories under which runtime loads (POST /v1/load_lora_adapter) may name an adapter "
        "(symlinks resolved first: none may lead out); none: runtime loading by path is refused.",
    )

    @field_validator("lora_modules_root", mode="before")
    @classmethod
    def _one_root(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_lengths(self) -> EngineConfig:
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is off"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.max_cpu_loras is not None and self.max_cpu_loras < len(self.lora_modules):
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= the number of lora_modules ({len(self.lora_modules)})"
            )
        if self.kv_offload_memory_gb > 0 and not self.enable_prefix_caching:
            raise ValueError("kv_offload_memory_gb: tier 2 of the prefix cache needs enable_prefix_caching")
        if any(not root for root in self.lora_modules_root):
            raise ValueError("lora_modules_root: a root must be a non-empty path")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config: method 'draft_model' runs at tensor_parallel_size 1 only "
                f"(got tensor_parallel_size {self.tensor_parallel_size}); use method 'ngram' at TP > 1"
            )
        bad = next((name for name in self.lora_modules if not name or name == self.model), None)
        if bad is not None:
            raise ValueError(f"lora_modules: adapter name {bad!r} must be non-empty and differ from the model's")
        return self

    @property
    def is_lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, len(self.lora_modules), DEFAULT_MAX_CPU_LORAS)

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return max(2048, self.max_num_seqs)
        return max(max_model_len, 2048, self.max_num_seqs)
