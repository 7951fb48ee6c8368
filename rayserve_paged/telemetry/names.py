"""The telemetry vocabulary: every instrument name and attribute key, in one place.

OpenTelemetry names use dots; the Prometheus exporter turns dots into underscores, appends
the unit (`By` -> `_bytes`, `s` -> `_seconds`; `1` and `{annotations}` add nothing) and
`_total` to counters:

    rayserve_paged.scheduler.preemptions  {preemption}  ->  rayserve_paged_scheduler_preemptions_total
    rayserve_paged.request.time_to_first_token  s       ->  rayserve_paged_request_time_to_first_token_seconds
    hw.gpu.memory.usage  By                             ->  hw_gpu_memory_usage_bytes

GPU figures use the OpenTelemetry hardware semantic conventions (`hw.gpu.*`) where one
exists; everything else lives under `rayserve_paged.`. docs/TELEMETRY.md lists them all.
"""

from __future__ import annotations

METER_NAME = "rayserve_paged"

# -- engine (scheduler actor): observable, read from the engine's counters at collection
KV_CACHE_BLOCKS = "rayserve_paged.kv_cache.blocks"  # {pool, state}
KV_CACHE_USAGE = "rayserve_paged.kv_cache.usage"  # {pool}: used / total
KV_CACHE_SWAPPED_BLOCKS = "rayserve_paged.kv_cache.swapped_blocks"  # {direction}
KV_CACHE_COPY_ON_WRITE_BLOCKS = "rayserve_paged.kv_cache.copy_on_write_blocks"
KV_CACHE_TOKEN_SLOTS = "rayserve_paged.kv_cache.token_slots"  # {pool, state}: used / allocated
KV_CACHE_FRAGMENTATION = "rayserve_paged.kv_cache.fragmentation"  # {pool}: 1 - used / allocated slots
KV_CACHE_SHARED_BLOCKS = "rayserve_paged.kv_cache.shared_blocks"  # {pool}: held by > 1 sequence
PREFIX_CACHE_QUERIES = "rayserve_paged.prefix_cache.queries"
PREFIX_CACHE_HITS = "rayserve_paged.prefix_cache.hits"
PREFIX_CACHE_TIER_HITS = "rayserve_paged.prefix_cache.tier_hits"  # {tier}: tokens found in each tier
PREFIX_CACHE_TIER_BLOCKS = "rayserve_paged.prefix_cache.tier_blocks"  # {tier, event}
SPEC_DECODE_NUM_DRAFT_TOKENS = "rayserve_paged.spec_decode.num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "rayserve_paged.spec_decode.num_accepted_tokens"
SPEC_DECODE_NUM_DRAFT_TOKENS_PER_POSITION = "rayserve_paged.spec_decode.num_draft_tokens_per_position"  # {position}
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POSITION = "rayserve_paged.spec_decode.num_accepted_tokens_per_position"
SCHEDULER_REQUESTS = "rayserve_paged.scheduler.requests"  # {state}
SCHEDULER_PREEMPTIONS = "rayserve_paged.scheduler.preemptions"  # {mode}
TOKENS = "rayserve_paged.tokens"  # {type}
GRAMMAR_ERRORS = "rayserve_paged.structured_outputs.grammar_errors"  # {stage}
GRAMMAR_CACHE_BYTES = "rayserve_paged.structured_outputs.cache.memory"  # compiled grammars in the cache

# -- engine with LoRA adapters (absent when the engine serves none): observable
LORA_ADAPTERS = "rayserve_paged.lora.adapters"  # {state}: registered | resident | active
LORA_SLOT_LOADS = "rayserve_paged.lora.slot_loads"
LORA_SLOT_EVICTIONS = "rayserve_paged.lora.slot_evictions"
LORA_REQUESTS = "rayserve_paged.lora.requests"  # {lora_name}

# -- engine: recorded once per finished request
REQUEST_FINISHED = "rayserve_paged.request.finished"  # {finish_reason}
REQUEST_TIME_TO_FIRST_TOKEN = "rayserve_paged.request.time_to_first_token"
REQUEST_TIME_PER_OUTPUT_TOKEN = "rayserve_paged.request.time_per_output_token"
REQUEST_E2E_LATENCY = "rayserve_paged.request.e2e_latency"
REQUEST_QUEUE_TIME = "rayserve_paged.request.queue_time"

# -- per TP rank (worker snapshots, recorded by the scheduler actor)
HW_GPU_MEMORY_USAGE = "hw.gpu.memory.usage"  # semconv
HW_GPU_MEMORY_LIMIT = "hw.gpu.memory.limit"  # semconv
HW_GPU_MEMORY_UTILIZATION = "hw.gpu.memory.utilization"  # semconv
HW_GPU_UTILIZATION = "hw.gpu.utilization"  # semconv
GPU_MEMORY_FREE = "rayserve_paged.gpu.memory.free"  # no semconv name for free bytes
TORCH_MEMORY_ALLOCATED = "rayserve_paged.torch.memory.allocated"
TORCH_MEMORY_RESERVED = "rayserve_paged.torch.memory.reserved"
TORCH_MEMORY_PEAK_ALLOCATED = "rayserve_paged.torch.memory.peak_allocated"
KV_CACHE_MEMORY = "rayserve_paged.kv_cache.memory"  # {pool}: bytes of the cache tensors

# -- attribute keys (Prometheus labels; dots become underscores)
REPLICA = "replica"
TP_RANK = "tp_rank"
GPU_INDEX = "gpu_index"  # NVML (physical) index, as nvidia-smi numbers GPUs
HW_ID = "hw.id"  # semconv: the GPU's UUID
HW_NAME = "hw.name"  # semconv: the GPU's product name
HW_GPU_TASK = "hw.gpu.task"  # semconv: "general" for the SM utilisation
POOL = "pool"  # DEVICE_POOL | SWAP_POOL
DEVICE_POOL = "device"  # the KV cache on the compute device: a GPU, or host RAM on a CPU-only run
SWAP_POOL = "cpu"  # the swap pool in host RAM
STATE = "state"
MODE = "mode"  # recompute | swap
DIRECTION = "direction"  # in | out
POSITION = "position"  # a draft's position in its row: 0 (the first draft), 1, ...
TIER = "tier"  # device | host (the prefix cache's tier 2, kv_offload_memory_gb)
TIER_EVENT = "event"  # device: evicted; host: offloaded | restored | evicted
TOKEN_TYPE = "type"  # prompt | generation
FINISH_REASON = "finish_reason"  # stop | length | abort
STAGE = "stage"  # consume | mask | mask_budget (where a grammar error happened)
LORA_NAME = "lora_name"  # the adapter's name (what a request's `model` says)

ENGINE_INSTRUMENTS = (
    KV_CACHE_BLOCKS,
    KV_CACHE_USAGE,
    KV_CACHE_SWAPPED_BLOCKS,
    KV_CACHE_COPY_ON_WRITE_BLOCKS,
    KV_CACHE_TOKEN_SLOTS,
    KV_CACHE_FRAGMENTATION,
    KV_CACHE_SHARED_BLOCKS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_TIER_HITS,
    PREFIX_CACHE_TIER_BLOCKS,
    SPEC_DECODE_NUM_DRAFT_TOKENS,
    SPEC_DECODE_NUM_ACCEPTED_TOKENS,
    SCHEDULER_REQUESTS,
    SCHEDULER_PREEMPTIONS,
    TOKENS,
    GRAMMAR_ERRORS,
    GRAMMAR_CACHE_BYTES,
    REQUEST_FINISHED,
    REQUEST_TIME_TO_FIRST_TOKEN,
    REQUEST_TIME_PER_OUTPUT_TOKEN,
    REQUEST_E2E_LATENCY,
    REQUEST_QUEUE_TIME,
)
SPEC_DECODE_POSITION_INSTRUMENTS = (SPEC_DECODE_NUM_DRAFT_TOKENS_PER_POSITION, SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POSITION)
LORA_INSTRUMENTS = (LORA_ADAPTERS, LORA_SLOT_LOADS, LORA_SLOT_EVICTIONS, LORA_REQUESTS)
NVML_INSTRUMENTS = (
    HW_GPU_MEMORY_USAGE,
    HW_GPU_MEMORY_LIMIT,
    HW_GPU_MEMORY_UTILIZATION,
    HW_GPU_UTILIZATION,
    GPU_MEMORY_FREE,
)
RANK_INSTRUMENTS = (
    *NVML_INSTRUMENTS,
    TORCH_MEMORY_ALLOCATED,
    TORCH_MEMORY_RESERVED,
    TORCH_MEMORY_PEAK_ALLOCATED,
    KV_CACHE_MEMORY,
)
