"""The engine: add_request / abort_request / step.

A step is schedule -> execute (the workers) -> process (append tokens, fork for best_of and
beam search, stop-token / EOS / length checks, free finished sequences). Everything a step
decides about KV memory comes from the scheduler; the engine only reports sequences'
progress to it.

A step returns deltas (engine/outputs.py): per advanced request, the token ids this step
added and counts, never text or history. Detokenization and stop strings run where the
outputs are read (engine/output_processor.py); a stop string found there comes back as
`stop_sequences`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.block_manager import BlockManager
from rayserve_paged.core.lora import LoRAKey, LoRARequest, LoRASlots, UnknownLoRAError, startup_lora_ids
from rayserve_paged.core.outputs import SchedulerOutput
from rayserve_paged.core.scheduler import Scheduler, SchedulerConfig
from rayserve_paged.core.spec_decode import SpeculativeConfig, count_positions
from rayserve_paged.core.sequence import (
    FINISH_REASONS,
    KV_CACHE_LIMIT,
    SamplingParams,
    SamplingParamsError,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from rayserve_paged.engine.detokenizer import DecodeState, Detokenizer
from rayserve_paged.engine.pooling import checkpoint_pooling
from rayserve_paged.engine.executor import Executor, InProcessExecutor
from rayserve_paged.engine.output_processor import find_stop
from rayserve_paged.engine.outputs import RequestMetrics, SequenceDelta, StepOutput
from rayserve_paged.engine.structured_outputs import CompiledGrammar, GrammarCompiler, StructuredOutputs
from rayserve_paged.models.loader import get_model_config, load_tokenizer, model_skeleton
from rayserve_paged.models.lora import LoRAError, check_adapter
from rayserve_paged.models.sampler import SamplerOutput, SeqSample
from rayserve_paged.models.tiny import resolve_model
from rayserve_paged.worker.draft_model import check_draft_model

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve as given; the message names the problem."""


@dataclass(slots=True)
class _BeamState:
    """HF-style beam search bookkeeping for one request (see _process_beam)."""

    finished: list[tuple[float, Sequence]] = field(default_factory=list)  # best first, <= width
    improvable: bool = True
    # with stop strings: each live beam's detokenization state and output text so far
    texts: dict[int, tuple[DecodeState, str]] = field(default_factory=dict)


def resolve_max_model_len(config: EngineConfig, model_max: int) -> int:
    """The longest sequence: the config's, at most the model's own."""
    wanted = config.max_model_len
    if wanted is None:
        return model_max
    if wanted > model_max:
        raise ValueError(f"max_model_len {wanted} is longer than the model's max_position_embeddings {model_max}")
    return wanted


def model_limits(config: EngineConfig) -> dict:
    """What request checks need of an engine, read from the model's config alone (no
    weights, no KV cache): {"model", "max_model_len", "vocab_size", "max_logprobs"}, as
    an engine's `model_info` gives them."""
    model_path = str(resolve_model(config.model))
    model_config = get_model_config(model_path)
    return {
        "model": config.model,
        "max_model_len": resolve_max_model_len(config, model_config.max_model_len),
        "vocab_size": model_config.vocab_size,
        "max_logprobs": config.max_logprobs,
        **task_info(config, model_path),
    }


def task_info(config: EngineConfig, model_path: str) -> dict:
    """{"task", "pooling"}: the served task and, for embed, the checkpoint's pooling rule
    (engine/pooling.py) as PoolingParams fields and the vector's size ("hidden_size")."""
    if config.task != "embed":
        return {"task": config.task, "pooling": None}
    pooling = checkpoint_pooling(model_path)
    return {
        "task": "embed",
        "pooling": {"pooling": pooling.pooling, "normalize": pooling.normalize},
        "hidden_size": get_model_config(model_path).hidden_size,
    }


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor_factory: Callable[[EngineConfig, str], Executor] = InProcessExecutor,
        tokenizer=None,
    ) -> None:
        self.config = config
        self.model_path = str(resolve_model(config.model))
        self.task_info = task_info(config, self.model_path)  # the served task, its pooling rule
        self.model_config = get_model_config(self.model_path)
        self.max_model_len = self._resolve_max_model_len()
        self._check_draft_model()
        self._tokenizer = tokenizer  # else loaded on first use (the `tokenizer` property)
        self._tokenizer_lock = threading.Lock()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.executor = executor_factory(config, self.model_path)
        sizes = self.executor.initialize()
        self.cache_sizes = sizes
        self._check_kv_fits(sizes.num_gpu_blocks)
        self.block_manager = BlockManager(
            config.block_size,
            sizes.num_gpu_blocks,
            sizes.num_cpu_blocks,
            watermark=config.watermark,
            enable_prefix_caching=self._prefix_caching(),
            sliding_window=self.model_config.sliding_window,
            kv_offload=config.kv_offload_memory_gb > 0,
        )
        self.lora_slots = LoRASlots(config.max_loras) if config.is_lora_enabled else None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                policy=config.scheduling_policy,
                max_num_batched_tokens=config.resolved_max_num_batched_tokens(self.max_model_len),
                max_model_len=self.max_model_len,
                preemption_mode=config.preemption_mode,
                enable_chunked_prefill=config.enable_chunked_prefill,
                recompute_at_len=self.model_config.rope_recompute_len,
                speculative=_speculative(config),
            ),
            self.block_manager,
            self.lora_slots,
        )
        self._detokenizer: Detokenizer | None = None  # beam search with stop strings only
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._beams: dict[str, _BeamState] = {}
        self._num_sent: dict[int, int] = {}  # seq id -> output tokens already emitted
        self._metrics: dict[str, RequestMetrics] = {}
        self._num_cached: dict[str, int] = {}  # request id -> prefix-cache hit, until its first output
        # request id -> per prompt position: that token's logprob and top-k (None for the
        # first), for requests with prompt_logprobs, until their first output
        self._prompt_logprobs: dict[str, list[dict[int, float] | None]] = {}
        self._pooled: dict[str, list[float] | None] = {}  # request id -> its vector, for its one output
        # structured outputs: grammars compiled off the step loop, a matcher per sequence
        self.grammars = GrammarCompiler(
            None, self.model_config.vocab_size, tuple(self.eos_token_ids), load_tokenizer=lambda: self.tokenizer
        )
        self.structured = StructuredOutputs(self.grammars)
        self._constrained: dict[str, SequenceGroup] = {}  # request id -> its group, while it lives
        self._mask_errors: dict[int, str] = {}  # this step's rows whose grammar failed at the mask
        self.num_prompt_tokens = 0  # computed prompt tokens (after prefix-cache hits)
        self.num_generation_tokens = 0
        self.spec_decode_num_accepted_tokens = 0  # drafts that verification kept
        # [j]: drafts at position j kept (a list as long as the scheduler's drafts per position)
        self.spec_decode_num_accepted_tokens_per_position = [0] * len(
            self.scheduler.counters.spec_decode_num_draft_tokens_per_position
        )
        # LoRA adapters by name (core/lora.py: identity); the model's layer shapes (a
        # meta-device skeleton) check them
        self.loras: dict[str, LoRARequest] = {}
        self.num_lora_requests: dict[str, int] = {}  # adapter name -> requests added with it
        self._lora_given: dict[str, tuple[int, str]] = {}  # name -> (id, path) as its caller gave them
        self._lora_keys: dict[int, LoRAKey] = {}  # every id ever drawn or given -> its adapter: never reused
        self._next_lora_id = len(config.lora_modules) + 1  # past the start-up ids
        self._lora_lock = threading.Lock()  # adapters are read (and ids drawn) off the step thread
        self._lora_bytes: dict[LoRAKey, int] = {}  # registered or retiring adapter -> its CPU bytes
        self._retiring: set[LoRAKey] = set()  # unregistered, still named by some request
        self._lora_roots = [os.path.realpath(root) for root in config.lora_modules_root]
        self._skeleton = model_skeleton(self.model_path) if config.is_lora_enabled else None
        for name, lora_id in startup_lora_ids(config.lora_modules).items():
            self.add_lora(LoRARequest(name, lora_id, str(config.lora_modules[name])))
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB) + %d CPU swap blocks",
            sizes.num_gpu_blocks,
            config.block_size,
            sizes.num_gpu_blocks * config.block_size,
            sizes.num_gpu_blocks * sizes.block_bytes / 2**20,
            sizes.num_cpu_blocks,
        )

    # ------------------------------------------------------------------ start-up checks

    def _check_draft_model(self) -> None:
        """A draft model (speculative_config method draft_model) fits the target: its
        vocabulary and context, checked before any worker starts."""
        spec = self.config.speculative_config
        if spec is not None and spec.method == "draft_model":
            draft = get_model_config(str(resolve_model(spec.model)))
            check_draft_model(self.model_config, draft, self.max_model_len)

    def _prefix_caching(self) -> bool:
        """Whether KV blocks are shared across requests: not for a model whose RoPE depends on
        the prompt's length (dynamic NTK, LongRoPE), whose cached K differ between a short and
        a long prompt with the same prefix."""
        if self.config.enable_prefix_caching and self.model_config.is_rope_length_dependent:
            logger.info("prefix caching off: the model's RoPE depends on each request's prompt length")
            return False
        return self.config.enable_prefix_caching

    def _resolve_max_model_len(self) -> int:
        return resolve_max_model_len(self.config, self.model_config.max_model_len)

    @property
    def tokenizer(self):
        """The HF tokenizer, loaded on first use: an engine behind a Serve replica gets token ids
        and sends token ids back (the replica holds its own tokenizer), so its process loads one
        only for a text prompt, a grammar or beam search with stop strings (~45 MiB resident
        for SmolLM2's)."""
        if self._tokenizer is None:
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self):
        return load_tokenizer(self.config.tokenizer or self.model_path, self.config.trust_remote_code)

    def _check_kv_fits(self, num_gpu_blocks: int) -> None:
        capacity = num_gpu_blocks * self.config.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_gpu_blocks} blocks x {self.config.block_size} = {capacity} tokens, "
                f"less than one sequence of max_model_len {self.max_model_len}: raise kv_cache_memory_gb / "
                "gpu_memory_utilization / num_gpu_blocks_override, or lower max_model_len"
            )

    # ------------------------------------------------------------------ LoRA adapters
    #
    # An adapter is read and checked once, at registration, off the step thread where a
    # caller can (prepare_lora), and its tensors go to the workers' CPU memory then; the
    # step thread only commits it (register_lora). Its identity is (id, resolved path,
    # digest of its weights): ids are never reused, so neither are slots, CPU entries or
    # prefix chains. Unloaded, it stays until the last request naming it ends (retiring).

    def add_lora(self, lora: LoRARequest) -> LoRARequest:
        """Register an adapter from a trusted caller (start-up, the offline API): any path,
        the caller's id. LoRAError names what does not fit (rank above max_lora_rank, an
        unknown target module, a shape, a malformed file). Adding the same name, id and
        path again is a no-op (the adapter is not read again); another adapter under a
        taken name, or an id once given to another adapter, is refused."""
        known = self.loras.get(lora.lora_name)
        as_given = (lora.lora_int_id, lora.lora_path)
        if known is not None and (lora == known or self._lora_given[known.lora_name] == as_given):
            return known
        registered, num_bytes = self.prepare_lora(lora.lora_name, lora.lora_path, lora.lora_int_id)
        return self.register_lora(registered, num_bytes, given_path=lora.lora_path)

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """A runtime load (a path under lora_modules_root) with the next id, in one call."""
        lora, num_bytes = self.prepare_lora(name, path, is_runtime=True)
        return self.register_lora(lora, num_bytes)

    def prepare_lora(
        self, name: str, path: str, lora_int_id: int | None = None, is_runtime: bool = False
    ) -> tuple[LoRARequest, int]:
        """Read and check the adapter, draw its id and give its tensors to the workers; the
        adapter, not yet registered, and its CPU bytes. Thread-safe (no step state is
        touched): the slow part of a load, run off the step thread by the SchedulerActor."""
        self._check_lora_name(name)
        resolved = self._resolve_lora_path(path, is_runtime)
        adapter = check_adapter(
            self._skeleton, resolved, self.config.max_lora_rank, int(self.config.max_lora_size_mb * 2**20)
        )
        self._check_lora_room(adapter.num_bytes)
        with self._lora_lock:
            if lora_int_id is None:
                lora_int_id = self._next_lora_id
            key = (lora_int_id, resolved, adapter.digest)
            known = self._lora_keys.get(lora_int_id)
            if known is not None and known != key:
                raise RequestError(
                    f"lora_int_id: {lora_int_id} was given to another adapter in this engine (ids are never reused)"
                )
            self._lora_keys[lora_int_id] = key
            self._next_lora_id = max(self._next_lora_id, lora_int_id + 1)
        lora = LoRARequest(name, lora_int_id, resolved, adapter.digest)
        if key not in self._lora_bytes:  # else the workers hold it already (it is retiring)
            self.executor.add_lora(key, adapter)
        return lora, adapter.num_bytes

    def register_lora(self, lora: LoRARequest, num_bytes: int, given_path: str | None = None) -> LoRARequest:
        """Commit a prepared adapter (on the step thread): requests may name it from now."""
        try:
            self._check_lora_name(lora.lora_name)
            other = next((n for n, known in self.loras.items() if known.key == lora.key), None)
            if other is not None:
                raise RequestError(f"lora_int_id: {lora.lora_int_id} is the LoRA adapter {other!r}'s")
            if lora.key not in self._lora_bytes:
                self._check_lora_room(num_bytes)
        except ValueError:
            if lora.key not in self._lora_bytes:
                self.lora_slots.retire(lora.key)  # the workers drop what they were given
            raise
        self._retiring.discard(lora.key)
        self._lora_bytes[lora.key] = num_bytes
        self.loras[lora.lora_name] = lora
        self._lora_given[lora.lora_name] = (lora.lora_int_id, given_path or lora.lora_path)
        self.num_lora_requests.setdefault(lora.lora_name, 0)
        return lora

    def _check_lora_name(self, name: str) -> None:
        if not self.config.is_lora_enabled:
            raise RequestError("LoRA adapters are not enabled: start the engine with enable_lora or lora_modules")
        known = self.loras.get(name)
        if known is not None:
            raise RequestError(f"lora_name: the LoRA adapter {name!r} is already loaded")
        if name == self.config.model:
            raise RequestError(f"lora_name: {name!r} is the base model's name")

    def _resolve_lora_path(self, path: str, is_runtime: bool) -> str:
        """The adapter directory, symlinks resolved; for a runtime load it must lie under a
        lora_modules_root (checked before the directory is looked at)."""
        if is_runtime and not self._lora_roots:
            raise LoRAError("runtime loading by path is off (no lora_modules_root is configured)")
        try:
            resolved = os.path.realpath(path)
        except (OSError, ValueError):
            raise LoRAError("not a usable path") from None
        if is_runtime and not any(resolved == root or resolved.startswith(root + os.sep) for root in self._lora_roots):
            raise LoRAError("must name a directory under lora_modules_root (after resolving symlinks)")
        return resolved

    def _check_lora_room(self, num_bytes: int) -> None:
        """Registered (and retiring) adapters within max_cpu_loras and max_cpu_lora_memory_gb."""
        limit, held = self.config.resolved_max_cpu_loras, dict(self._lora_bytes)
        if len(held) >= limit:
            raise RequestError(f"lora_name: {limit} LoRA adapters are registered, max_cpu_loras; unload one first")
        budget = self.config.max_cpu_lora_memory_gb * 2**30
        if sum(held.values()) + num_bytes > budget:
            raise LoRAError(
                f"the adapter's {num_bytes / 2**20:.1f} MiB do not fit in max_cpu_lora_memory_gb "
                f"({self.config.max_cpu_lora_memory_gb:g}) beside the adapters registered"
            )

    def lora_by_name(self, name: str) -> LoRARequest:
        lora = self.loras.get(name)
        if lora is None:
            raise UnknownLoRAError(f"model: the model {name!r} does not exist (no LoRA adapter of that name is loaded)")
        return lora

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter: new requests cannot name it, its metric series go; requests
        running with it finish, then its slot and tensors are freed."""
        lora = self.loras.pop(name, None)
        if lora is None:
            return False
        self._lora_given.pop(name, None)
        self.num_lora_requests.pop(name, None)
        self._retiring.add(lora.key)
        self._retire_unused_loras()
        self._flush_worker_state()
        return True

    def _retire_unused_loras(self) -> None:
        """Retire each unloaded adapter no request names any more (core/lora.py)."""
        if not self._retiring:
            return
        used = {g.lora_key for g in self.scheduler.groups.values() if g.lora_request is not None}
        for key in [k for k in self._retiring if k not in used]:
            self._retiring.discard(key)
            self._lora_bytes.pop(key, None)
            self.lora_slots.retire(key)

    def _fail_loras(self, failures: list[tuple[LoRAKey, str]]) -> tuple[list[StepOutput], set[str]]:
        """Adapters the workers could not activate: each is unloaded and only its requests
        end, with the reason; its slot is rolled back (freed). (outputs, their request ids)"""
        outputs = []
        for key, reason in failures:
            name = next((n for n, lora in self.loras.items() if lora.key == key), None)
            if name is not None:
                self.loras.pop(name)
                self._lora_given.pop(name, None)
                self.num_lora_requests.pop(name, None)
            self._retiring.add(key)
            shown = repr(name) if name is not None else f"id {key[0]}"
            error = f"model: the LoRA adapter {shown} could not be activated ({reason}); it was unloaded"
            for group in [g for g in self.scheduler.groups.values() if g.lora_key == key]:
                self.scheduler.abort(group.request_id)
                metrics = self._metrics.get(group.request_id)
                outputs.append(StepOutput(group.request_id, [], finished=True, metrics=metrics, error=error))
                self._forget(group)
        self._retire_unused_loras()
        return outputs, {out.request_id for out in outputs}

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        sampling_params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | str | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> None:
        """Queue a request (on `lora_request`'s adapter, registered now if it is new, or on
        the registered adapter of that name); raises RequestError / SamplingParamsError /
        LoRAError for bad input, UnknownLoRAError for an adapter name not registered.

        A constrained request brings its compiled grammar (`compile_constraint`, called
        off the step loop); without one only a grammar the cache holds compiled now will
        do: add_request never compiles and never waits for a compile."""
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise RequestError("prompt: give a string or prompt_token_ids")
            prompt_token_ids = self.encode(prompt)
        self._validate(request_id, prompt_token_ids, sampling_params)
        matcher = self._request_matcher(sampling_params, grammar)
        if isinstance(lora_request, str):
            lora_request = self.lora_by_name(lora_request)
        elif lora_request is not None:
            lora_request = self.add_lora(lora_request)
        seq = Sequence(next(self._seq_ids), prompt_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = SequenceGroup(request_id, [seq], sampling_params, arrival, next(self._arrivals), lora_request)
        if lora_request is not None:
            self.num_lora_requests[lora_request.lora_name] = self.num_lora_requests.get(lora_request.lora_name, 0) + 1
        if matcher is not None:
            self.structured.add(seq.seq_id, matcher, sampling_params.structured_outputs.after_token_id)
            self._constrained[request_id] = group
        self.scheduler.add_group(group)
        self._metrics[request_id] = RequestMetrics(arrival_time=arrival)
        if sampling_params.use_beam_search:
            self._beams[request_id] = _BeamState()
        if sampling_params.prompt_logprobs is not None:  # filled by the prefill, sent with the first output
            self._prompt_logprobs[request_id] = [None] * len(prompt_token_ids)

    def _validate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params: expected rayserve_paged.SamplingParams")
        if request_id in self.scheduler.groups:
            raise RequestError(f"request_id {request_id!r} is already in use")
        if not token_ids:
            raise RequestError("prompt: empty prompt (no tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt_token_ids: {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within max_model_len {self.max_model_len}"
            )
        bad_bias = next((t for t in params.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise SamplingParamsError(f"logit_bias: token id {bad_bias} is outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise SamplingParamsError(f"logprobs: at most {self.config.max_logprobs} (got {params.logprobs})")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.config.max_logprobs:
            raise SamplingParamsError(
                f"prompt_logprobs: at most {self.config.max_logprobs} (got {params.prompt_logprobs})"
            )
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
            after = params.structured_outputs.after_token_id
            if after is not None and after >= vocab:
                raise SamplingParamsError(
                    f"structured_outputs.after_token_id: {after} is outside the vocabulary [0, {vocab})"
                )
        if params.best_of > self.config.max_num_seqs:
            raise SamplingParamsError(
                f"best_of: {params.best_of} sequences exceed max_num_seqs {self.config.max_num_seqs}"
            )

    def prepare_constraint(self, params: SamplingParams):
        """Start compiling the request's grammar (a future of its CompiledGrammar; None
        without a constraint): a caller off the step loop awaits it and hands the result to
        add_request, so the step loop never waits for a compile. Thread-safe."""
        if params.structured_outputs is None:
            return None
        return self.grammars.submit(params.structured_outputs)

    def compile_constraint(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's compiled grammar, waiting for it (at most the compile timeout):
        for callers that are not the step loop (LLM.generate). Thread-safe."""
        if not isinstance(params, SamplingParams) or params.structured_outputs is None:
            return None
        return self.grammars.compile(params.structured_outputs)

    def _request_matcher(self, params: SamplingParams, grammar: CompiledGrammar | None):
        """The new request's own matcher (None: unconstrained); fails at once when its
        grammar is not at hand compiled."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        if grammar is None:
            grammar = self.grammars.cached(constraint)
        if grammar is None:
            raise SamplingParamsError(
                f"structured_outputs.{constraint.kind}: the grammar is not compiled (compile it off the "
                "step loop first: LLMEngine.compile_constraint)"
            )
        return grammar.new_matcher()

    def abort_request(self, request_id: str) -> bool:
        group = self.scheduler.abort(request_id)
        if group is not None:
            self._forget(group)
            self._retire_unused_loras()
            self._flush_worker_state()
        return group is not None

    def stop_sequences(self, request_id: str, stops: list[tuple[int, str]]) -> StepOutput | None:
        """Finish the choices a stop string ended (choice index, the stop string) and free
        their blocks; the request's finished output when no choice is left running."""
        group = self.scheduler.groups.get(request_id)
        if group is None or group.sampling_params.use_beam_search:
            return None
        params = group.sampling_params
        stops = [(index, stop) for index, stop in stops if index < len(group.seqs)]
        for index, stop in stops:
            if not group.seqs[index].status.is_finished:
                self._finish(group.seqs[index], SequenceStatus.FINISHED_STOPPED, stop)
        if not group.is_finished():
            self.scheduler.free_finished(group)
            return None
        self.scheduler.abort(request_id)  # out of every queue (it may be waiting or swapped)
        self._retire_unused_loras()
        self._flush_worker_state()
        stopped = [_delta(i, group.seqs[i], params, group.seqs[i].num_output_tokens) for i, _ in stops]
        out = StepOutput(request_id, stopped, finished=True, metrics=self._metrics.get(request_id))
        if out.metrics is not None:
            out.metrics.finished_time = time.monotonic()
        self._forget(group)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_groups()

    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished_groups

    # ------------------------------------------------------------------ the step

    def step(self) -> list[StepOutput]:
        """One iteration; returns a delta for every request that advanced or ended."""
        out = self.scheduler.schedule()
        now = time.monotonic()
        results = [self._ignored_output(rid) for rid in out.ignored]
        if out.is_empty:
            self._retire_unused_loras()
            return results
        self._mask_errors = {}
        if self._constrained:
            self._fill_bitmasks(out)
        try:
            sampled = self.executor.execute(out.message)
        except Exception:
            # the step's K/V may be missing: no cached prefix from it may be reused
            self.block_manager.reset_prefix_cache()
            raise
        failed: set[str] = set()
        if sampled.lora_failures:
            failures, failed = self._fail_loras(sampled.lora_failures)
            results += failures
        results += self._process(out, sampled, now, failed)
        self._retire_unused_loras()
        self._flush_worker_state()
        return results

    def _flush_worker_state(self) -> None:
        """When the last requests have ended, tell the workers now rather than with some
        later request's first step, so that no request's state outlives it on a worker."""
        if self.scheduler.has_unfinished_groups():
            return
        out = self.scheduler.schedule()
        if not out.is_empty:
            self.executor.execute(out.message)

    def _process(
        self, out: SchedulerOutput, sampled: SamplerOutput, now: float, failed: set[str] = frozenset()
    ) -> list[StepOutput]:
        samples = sampled.samples
        msg = out.message
        counts = msg.num_query_tokens
        results = []
        next_sample = 0
        drafting = set(msg.draft_seq_ids)
        for group, first_row, num_rows, do_sample, is_first_step in out.scheduled:
            request_id = group.request_id
            if request_id in failed:  # its adapter failed: its rows ran without it, and it ended
                next_sample += num_rows if do_sample else 0
                continue
            metrics = self._metrics[request_id]
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                # the prefix cache's hit, reported with the first output (after the last chunk)
                self._num_cached[request_id] = msg.start_positions[first_row]
            if len(group.seqs) == 1 and group.seqs[0].num_output_tokens == 0:  # prompt tokens
                self.num_prompt_tokens += sum(counts[first_row : first_row + num_rows])
            if sampled.prompt_logprobs and request_id in self._prompt_logprobs:
                self._record_prompt_logprobs(request_id, msg.seq_ids[first_row : first_row + num_rows], sampled)
            if not do_sample:  # a prefill chunk: nothing sampled, nothing to report
                continue
            group_samples = samples[next_sample : next_sample + num_rows]
            next_sample += num_rows
            if group.sampling_params.pooling is not None:  # the prompt is done: its vector, no token
                self._pooled[request_id] = sampled.pooled.get(group.seqs[0].seq_id)
                self._finish(group.seqs[0], SequenceStatus.FINISHED_STOPPED, None)
            elif group.sampling_params.use_beam_search:
                self._process_beam(group, group_samples)
            else:
                self._process_samples(group, group_samples, is_first_step)
            self.num_generation_tokens += num_rows
            if drafting:
                self._keep_accepted(group, group_samples, drafting)
            if metrics.first_token_time is None:
                metrics.first_token_time = time.monotonic()
            self.scheduler.free_finished(group)
            result = self._step_output(group, self._num_cached.pop(request_id, 0))
            if result is not None:
                results.append(result)
            if group.is_finished():
                self._forget(group)
        for rid in out.preempted:
            if rid in self._metrics:
                self._metrics[rid].num_preemptions += 1
        return results

    def _record_prompt_logprobs(self, request_id: str, seq_ids: list[int], sampled: SamplerOutput) -> None:
        """Place the step's prompt logprobs by position (a recomputed chunk writes the same)."""
        scores = self._prompt_logprobs[request_id]
        for seq_id in seq_ids:
            entry = sampled.prompt_logprobs.get(seq_id)
            if entry is not None:
                first, tops = entry
                scores[first : first + len(tops)] = tops

    def _fill_bitmasks(self, out: SchedulerOutput) -> None:
        """The token bitmasks of the step's constrained sampled rows, into its message; the
        rows whose grammar fails here end with a grammar error once the step is sampled."""
        msg = out.message
        seq_ids = []
        matchers = self.structured.matchers
        for group, first_row, num_rows, do_sample, _ in out.scheduled:
            if do_sample and group.request_id in self._constrained:
                seq_ids += [s for s in msg.seq_ids[first_row : first_row + num_rows] if s in matchers]
        if seq_ids:
            msg.bitmask_seq_ids = seq_ids
            msg.token_bitmasks, self._mask_errors = self.structured.fill(seq_ids)

    def _new_child(self, group: SequenceGroup, parent: Sequence, with_blocks: bool = True) -> Sequence:
        child = parent.fork(next(self._seq_ids))
        if group.request_id in self._constrained:
            self.structured.fork(parent.seq_id, child.seq_id)
        if with_blocks:
            self.scheduler.fork_seq(group, parent, child)
        return child

    # ------------------------------------------------------------------ sampling, best_of

    def _process_samples(self, group: SequenceGroup, samples: list[SeqSample], is_first_step: bool) -> None:
        by_id = {s.seq_id: s for s in group.seqs}
        params = group.sampling_params
        is_constrained = group.request_id in self._constrained
        for sample in samples:
            seq = by_id[sample.seq_id]
            if not is_first_step and len(sample.token_ids) > 1:  # verified drafts, then one more
                self._append_verified(seq, sample, params)
                continue
            picks = list(range(len(sample.token_ids)))
            # first step of best_of > 1: one draw per sequence; the parent forks the others
            children = [self._new_child(group, seq) for _ in picks[1:]] if is_first_step else []
            mask_error = self._mask_errors.get(seq.seq_id)
            for target, i in zip([seq, *children], picks):
                if mask_error is not None:  # sampled without its grammar: the token is dropped
                    self._end_with_grammar_error(target, params, mask_error)
                    continue
                target.append_token(sample.token_ids[i], sample.logprobs[i])
                if sample.top_logprobs is not None:
                    target.output_logprobs.append(sample.top_logprobs[i])
                is_complete, error = (
                    self.structured.accept(target.seq_id, sample.token_ids[i]) if is_constrained else (False, None)
                )
                self._check_stop(target, params)
                if error is not None:
                    self._end_with_grammar_error(target, params, error)
                elif is_complete and target.status is not SequenceStatus.FINISHED_STOPPED:
                    # the grammar is complete (only EOS may follow): the output is whole
                    self._finish(target, SequenceStatus.FINISHED_STOPPED, None)

    def _append_verified(self, seq: Sequence, sample: SeqSample, params: SamplingParams) -> None:
        """A speculative step's tokens, one at a time as separate steps would append them:
        the first that ends the sequence (stop token, EOS, a length) is its last."""
        for i, token in enumerate(sample.token_ids):
            seq.append_token(token, sample.logprobs[i])
            if sample.top_logprobs is not None:
                seq.output_logprobs.append(sample.top_logprobs[i])
            self._check_stop(seq, params)
            if seq.status.is_finished:
                return

    def _keep_accepted(self, group: SequenceGroup, samples: list[SeqSample], drafting: set[int]) -> None:
        """The drafting sequences keep their accepted drafts' K/V; the rest is rolled back."""
        for sample in samples:
            if sample.seq_id not in drafting:
                continue
            self.spec_decode_num_accepted_tokens += len(sample.token_ids) - 1
            count_positions(self.spec_decode_num_accepted_tokens_per_position, len(sample.token_ids) - 1)
            self.num_generation_tokens += len(sample.token_ids) - 1
            seq = next(s for s in group.seqs if s.seq_id == sample.seq_id)
            if not seq.status.is_finished:
                self.scheduler.accept_drafts(seq)

    def _end_with_grammar_error(self, seq: Sequence, params: SamplingParams, error: str) -> None:
        """A grammar that cannot go on ends the sequence visibly (finish_reason "abort",
        stop_reason the error), never as a stop; a grammar that failed leaves the cache."""
        self._finish(seq, SequenceStatus.FINISHED_ABORTED, error)
        self.structured.remove(seq.seq_id)
        self.grammars.discard(params.structured_outputs)

    def _check_stop(self, seq: Sequence, params: SamplingParams) -> None:
        """Stop tokens, EOS and lengths; stop strings are the output processor's."""
        token = seq.token_ids[-1]
        if token in params.stop_token_ids:
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, token)
        elif not params.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, None)
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, None)
        elif len(seq) >= self.max_model_len:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, None)

    @staticmethod
    def _finish(seq: Sequence, status: SequenceStatus, reason: int | str | None) -> None:
        seq.status = status
        seq.stop_reason = reason

    # ------------------------------------------------------------------ beam search

    def _process_beam(self, group: SequenceGroup, samples: list[SeqSample]) -> None:
        """One step of beam search as HF transformers' `generate(num_beams=W)` does it.

        The best K = factor * W continuations over all beams (by cumulative logprob) are
        ranked; among the top W, those that end (EOS, stop token, length) enter the
        finished set with score cum_logprob / generated_len ** length_penalty (the W best
        are kept); the best W that do not end become the next beams (forks of their
        parents, so shared blocks stay shared). The search ends when all top K end, when
        W finished hypotheses exist and early_stopping is True, or when no running beam
        can still beat the worst finished one.
        """
        params = group.sampling_params
        width = params.best_of
        state = self._beams[group.request_id]
        self._keep_cut_beams(group, state)
        by_id = {s.seq_id: s for s in group.seqs}
        candidates = []  # (score, parent, token, logprob)
        for sample in samples:
            parent = by_id[sample.seq_id]
            for token, logprob in zip(sample.token_ids, sample.logprobs):
                candidates.append((parent.cumulative_logprob + logprob, parent, token, logprob))
        candidates.sort(key=lambda c: c[0], reverse=True)
        num_keep = len(samples[0].token_ids) if samples else 0
        top = candidates[:num_keep]
        generated = by_id[samples[0].seq_id].num_output_tokens + 1  # all beams have one length
        texts = self._candidate_texts(group, state, top) if params.stop else None
        ends = [self._beam_ends(parent, token, generated, params, texts) for _, parent, token, _ in top]

        # finished hypotheses: only the top W candidates may enter
        full = len(state.finished) == width
        if state.improvable and not (full and params.early_stopping is True):
            for (score, parent, token, logprob), end in zip(top[:width], ends[:width]):
                if end is not None:
                    hyp = self._new_child(group, parent, with_blocks=False)
                    hyp.append_token(token, logprob)
                    hyp.status, hyp.stop_reason = end
                    state.finished.append((score / generated**params.length_penalty, hyp))
            state.finished.sort(key=lambda f: f[0], reverse=True)
            del state.finished[width:]

        survivors = [c for c, end in zip(top, ends) if end is None][:width]
        if len(state.finished) == width and survivors:
            best_len = generated
            if params.early_stopping == "never" and params.length_penalty > 0:
                best_len = params.max_tokens if params.max_tokens is not None else self.max_model_len
            best_possible = survivors[0][0] / best_len**params.length_penalty
            state.improvable = state.improvable and best_possible > state.finished[-1][0]
        done = (
            not survivors
            or not state.improvable
            or (len(state.finished) == width and params.early_stopping is True)
        )
        if done:
            for seq in group.seqs:
                if not seq.status.is_finished:
                    self._finish(seq, SequenceStatus.FINISHED_ABORTED, None)  # discarded beams
            return
        self._advance_beams(group, survivors, state, texts)

    def _keep_cut_beams(self, group: SequenceGroup, state: _BeamState) -> None:
        """Beams the scheduler ended because the KV pool could not hold the whole beam
        (finish_reason "length", stop_reason KV_CACHE_LIMIT) are finished hypotheses, as
        beams that reach max_tokens are."""
        params = group.sampling_params
        cut = [s for s in group.seqs if s.status is SequenceStatus.FINISHED_LENGTH and s.stop_reason == KV_CACHE_LIMIT]
        for seq in cut:
            score = seq.cumulative_logprob / max(seq.num_output_tokens, 1) ** params.length_penalty
            state.finished.append((score, seq))
        if cut:
            state.finished.sort(key=lambda f: f[0], reverse=True)
            del state.finished[params.best_of :]
            group.seqs[:] = [s for s in group.seqs if s not in cut]

    def _beam_ends(
        self, parent: Sequence, token: int, generated: int, params: SamplingParams, texts: dict | None
    ) -> tuple[SequenceStatus, int | str | None] | None:
        """How the candidate (parent + token) ends, as (status, stop_reason); None: it goes on."""
        if token in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED, token
        if not params.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED, None
        if texts is not None and (stop := texts[parent.seq_id, token][2]) is not None:
            return SequenceStatus.FINISHED_STOPPED, stop
        if params.max_tokens is not None and generated >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH, None
        if len(parent) + 1 >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None
        return None

    def _candidate_texts(self, group: SequenceGroup, state: _BeamState, top: list) -> dict:
        """(parent id, token) -> (its decode state, its output text, the stop string its new
        text completes or None): each hypothesis meets the stop strings as greedy output
        does, through the same incremental detokenization (its text is cut there later)."""
        params = group.sampling_params
        skip = params.skip_special_tokens
        if self._detokenizer is None:
            self._detokenizer = Detokenizer(self.tokenizer)
        detok = self._detokenizer
        texts = {}
        for _, parent, token, _ in top:
            key = (parent.seq_id, token)
            if key in texts:
                continue
            known = state.texts.get(parent.seq_id)
            if known is None:  # the first step: the beam's text starts after the prompt
                known = (detok.start(parent.prompt_token_ids, skip), "")
            decode, text = known
            decode = detok.copy(decode)
            before = len(text)
            text += detok.decode_next(decode, token, skip)
            found = find_stop(text, params.stop, before)
            texts[key] = (decode, text, None if found is None else found[0])
        return texts

    def _advance_beams(self, group: SequenceGroup, survivors: list, state: _BeamState, texts: dict | None) -> None:
        """Turn the surviving candidates into the next beams: a parent chosen once takes
        the token itself, each further choice forks it; unchosen beams are dropped."""
        used: set[int] = set()
        moves = []
        for _, parent, token, logprob in survivors:
            if parent.seq_id in used:
                child = self._new_child(group, parent)
                used.add(child.seq_id)
                moves.append((child, parent, token, logprob))
            else:
                used.add(parent.seq_id)
                moves.append((parent, parent, token, logprob))
        if texts is not None:
            state.texts = {beam.seq_id: texts[parent.seq_id, token][:2] for beam, parent, token, _ in moves}
        # children were forked before any parent took its token
        for beam, _, token, logprob in moves:
            beam.append_token(token, logprob)
        for seq in group.seqs:
            if seq.seq_id not in used and not seq.status.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED, None)
        self.scheduler.free_finished(group)
        group.seqs[:] = [s for s in group.seqs if not s.status.is_finished]

    # ------------------------------------------------------------------ outputs

    def _step_output(self, group: SequenceGroup, num_cached: int) -> StepOutput | None:
        """What this step added to the group's sequences (None: nothing to say). A beam
        search speaks once, finished: its n best hypotheses, whole."""
        params = group.sampling_params
        finished = group.is_finished()
        metrics = self._metrics.get(group.request_id)
        if finished and metrics is not None:
            metrics.finished_time = time.monotonic()
        if params.use_beam_search:
            if not finished:
                return None
            hyps = [hyp for _, hyp in self._beams[group.request_id].finished[: params.n]]
            deltas = [_delta(i, hyp, params, 0) for i, hyp in enumerate(hyps)]
        else:
            deltas = []
            for index, seq in enumerate(group.seqs):
                num_sent = self._num_sent.get(seq.seq_id, 0)
                if num_sent >= 0 and (seq.num_output_tokens > num_sent or seq.status.is_finished):
                    deltas.append(_delta(index, seq, params, num_sent))
                    # a finished sequence is reported once: -1 marks it done
                    self._num_sent[seq.seq_id] = -1 if seq.status.is_finished else seq.num_output_tokens
        return StepOutput(
            group.request_id,
            deltas,
            finished=finished,
            num_cached_tokens=num_cached,
            metrics=metrics if finished else None,
            prompt_logprobs=self._prompt_logprobs.pop(group.request_id, None),
            pooled=self._pooled.pop(group.request_id, None),
        )

    def _ignored_output(self, request_id: str) -> StepOutput:
        metrics = self._metrics.pop(request_id, None)
        self._forget_constraint(request_id)
        self._beams.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        return StepOutput(
            request_id,
            [],
            finished=True,
            metrics=metrics,
            error=(
                f"the request can never fit in the KV cache of {self.block_manager.gpu.num_blocks} blocks x "
                f"{self.block_manager.block_size} tokens (prompt longer than max_model_len {self.max_model_len}, "
                "or more than the whole pool): raise kv_cache_memory_gb / num_gpu_blocks_override"
            ),
        )

    def _forget_constraint(self, request_id: str) -> None:
        """Drop the matchers of a constrained request's sequences (nothing for a free one)."""
        group = self._constrained.pop(request_id, None)
        if group is not None:
            for seq in group.seqs:
                self.structured.remove(seq.seq_id)

    def _forget(self, group: SequenceGroup) -> None:
        self._forget_constraint(group.request_id)
        self._beams.pop(group.request_id, None)
        self._num_cached.pop(group.request_id, None)
        self._prompt_logprobs.pop(group.request_id, None)
        self._pooled.pop(group.request_id, None)
        self._metrics.pop(group.request_id, None)
        for seq in group.seqs:
            self._num_sent.pop(seq.seq_id, None)


def _speculative(config: EngineConfig) -> SpeculativeConfig | None:
    spec = config.speculative_config
    if spec is None:
        return None
    return SpeculativeConfig(
        spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, spec.disable_by_batch_size,
        spec.method, spec.min_accepted_per_step,
    )


def _delta(index: int, seq: Sequence, params: SamplingParams, num_sent: int) -> SequenceDelta:
    start = seq.num_prompt_tokens + num_sent
    finish = FINISH_REASONS.get(seq.status) if seq.status.is_finished else None
    return SequenceDelta(
        index=index,
        token_ids=seq.token_ids[start:],
        top_logprobs=seq.output_logprobs[num_sent:] if params.logprobs is not None else None,
        cumulative_logprob=seq.cumulative_logprob,
        num_output_tokens=seq.num_output_tokens,
        finish_reason=finish,
        stop_reason=seq.stop_reason if finish is not None else None,
    )
