"""The SchedulerActor: a Ray actor that owns the LLMEngine (block manager, scheduler,
sequence groups) and runs its step loop while work exists.

    callers (asyncio)                      step thread
    add_request / abort  ── ops queue ──>  apply ops between steps ─> engine.step()
    stop_sequences
    outputs() stream     <── per step ───  every advanced request's delta, one batch

At tensor_parallel_size 1 the worker (rank 0) lives in this process, so a step is a function
call; at TP > 1 the executor drives worker actors (ray_executor.py).

The engine is not thread-safe, so only the step thread touches it; requests and aborts
wait in a queue and are applied between steps, so they never block the loop. Outputs leave
as one batch per step on a single stream (one object per step, not one per token per
request; steps that queued while the stream was busy leave together); each carries only
what the step added (token ids and counts: no text, no history). The owner detokenizes,
checks stop strings (sending back `stop_sequences`) and dispatches them to its requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from rayserve_paged.config import EngineConfig
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.frontend import EngineUnavailable
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.engine.structured_outputs import CompiledGrammar
from rayserve_paged.models.loader import release_freed_memory
from rayserve_paged.telemetry import ReplicaTelemetry, TelemetryConfig

logger = logging.getLogger(__name__)


def _one_torch_thread() -> None:
    import torch

    torch.set_num_threads(1)  # this thread's own setting (OpenMP's is per thread)


@dataclass(slots=True)
class StepTiming:
    steps: int = 0
    step_s: float = 0.0  # wall time of engine.step() in total
    idle_s: float = 0.0  # wall time the loop waited with nothing to step, after its first step
    span_s: float = 0.0  # wall time from the first step's start to the last step's end


class SchedulerActor:
    def __init__(
        self, config: EngineConfig, worker_cpus: float = 1.0, executor: str = "auto", telemetry: dict | None = None
    ) -> None:
        """`executor`: "auto" runs rank 0 in this process at TP = 1 and worker actors at
        TP > 1; "ray" always uses worker actors; "in-process" never does."""
        if executor == "auto":
            from rayserve_paged.engine.ray_executor import rank0_in_scheduler

            executor = "in-process" if rank0_in_scheduler(config) else "ray"
        if executor == "ray":
            from rayserve_paged.engine.ray_executor import RayExecutor

            factory = lambda c, p: RayExecutor(c, p, worker_cpus=worker_cpus)  # noqa: E731
        elif executor == "in-process":
            factory = None
        else:
            raise ValueError(f"executor: expected 'auto', 'ray' or 'in-process' (got {executor!r})")
        self._ops: deque = deque()
        self._wake = threading.Event()
        self._batches: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._alive = True
        self._error: BaseException | None = None
        self.timing = StepTiming()
        # one thread reads adapters, its torch work on one thread (no second OpenMP team
        # beside the step thread's)
        self._lora_loader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="lora-load", initializer=_one_torch_thread
        )
        # The engine is built on the step thread, which then runs every step: the model's torch
        # and compiled-kernel work all starts its OpenMP parallel regions from that one thread,
        # so the process has one OpenMP team. (Built here on the actor's thread, the load and
        # the KV profile would leave a second team behind; with more OpenMP threads than CPUs
        # libgomp spins ~1000 times instead of ~300k before sleeping, and every parallel region
        # of every step pays a wake-up: a two-thread replica ran one stream no faster than a
        # one-thread one, docs/benchmarks/15-quantized.md (15a).)
        def build() -> None:  # on the step thread, before its loop
            self.engine = LLMEngine(config, executor_factory=factory) if factory else LLMEngine(config)
            self.telemetry = ReplicaTelemetry(self.engine, TelemetryConfig.model_validate(telemetry or {}))

        built: concurrent.futures.Future = concurrent.futures.Future()
        self.engine: LLMEngine
        self.telemetry: ReplicaTelemetry
        self._thread = threading.Thread(target=self._run, args=(build, built), name="step-loop", daemon=True)
        self._thread.start()
        built.result()  # the construction's error, raised here

    # ------------------------------------------------------------------ called by the owner

    async def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request (on the registered LoRA adapter `lora_name`, None: the base model);
        raises the engine's validation error for bad input."""
        self._attach_loop()
        if self._error is not None:
            raise EngineUnavailable(f"the engine failed: {self._error!r}")
        grammar = await self._wait_for_grammar(params)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("add", (request_id, prompt, params, prompt_token_ids, None, lora_name, grammar), done))
        await asyncio.wrap_future(done)

    async def load_lora(self, name: str, path: str) -> dict:
        """Register the adapter in `path` under `name` (a directory under lora_modules_root,
        checked against the model first: LoRAError names what does not fit); its
        {"lora_name", "lora_int_id", "lora_path"}. The adapter is read, checked and handed
        to the workers on a loader thread: the steps go on meanwhile; only the commit runs
        on the step thread."""
        self._attach_loop()
        if self._error is not None:
            raise EngineUnavailable(f"the engine failed: {self._error!r}")
        loop = asyncio.get_running_loop()
        prepare = self.engine.prepare_lora
        lora, num_bytes = await loop.run_in_executor(self._lora_loader, prepare, name, path, None, True)
        lora = await self._call(lambda: self.engine.register_lora(lora, num_bytes))
        return {"lora_name": lora.lora_name, "lora_int_id": lora.lora_int_id, "lora_path": lora.lora_path}

    async def unload_lora(self, name: str) -> bool:
        """Forget the adapter (requests running with it finish); False: no such adapter."""
        return await self._call(lambda: self.engine.remove_lora(name))

    async def _call(self, fn):
        """fn() on the step thread, between steps (the engine is not thread-safe)."""
        self._attach_loop()
        if self._error is not None:
            raise EngineUnavailable(f"the engine failed: {self._error!r}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, done))
        return await asyncio.wrap_future(done)

    async def _wait_for_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """A constrained request waits here, off the step loop, until its grammar is
        compiled (or the compile fails or runs past the limit: the caller's error, and the
        compile is abandoned); the compiled grammar travels with the request into the step
        thread, which never compiles (a cache eviction meanwhile changes nothing)."""
        if not isinstance(params, SamplingParams):
            return None  # the engine names the problem
        if params.structured_outputs is not None and not self.engine.grammars.tokenizer_ready:
            # the first grammar loads the tokenizer: a one-time cost, not the grammar's, so
            # outside the compile limit (and off the event loop)
            await asyncio.get_running_loop().run_in_executor(None, self.engine.grammars.ll_tokenizer)
        compiled = self.engine.prepare_constraint(params)
        if compiled is None:
            return None
        grammars = self.engine.grammars
        # asyncio.wait, not wait_for: a caller that goes away must not cancel the shared compile
        waiter = asyncio.wrap_future(compiled)
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # raised below
        await asyncio.wait({waiter}, timeout=grammars.timeout_s)
        if not compiled.done():
            raise grammars.give_up(params.structured_outputs, compiled)
        if compiled.cancelled():  # abandoned by another waiter's timeout while queued
            raise grammars.give_up(params.structured_outputs, compiled)
        return compiled.result()  # a compile error is the caller's, raised here

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id, None))

    async def stop_sequences(self, request_id: str, stops: list[tuple[int, str]]) -> None:
        """Choices a stop string ended (found by the owner's output processor)."""
        self._submit(("stop", (request_id, stops), None))

    async def outputs(self):
        """Streaming: one list of StepOutputs (deltas) per step in which any request advanced;
        steps published while the stream was busy travel together, in step order, as one item."""
        self._attach_loop()
        while True:
            batch = await self._batches.get()
            if isinstance(batch, BaseException):
                raise batch
            failure = None
            while failure is None and not self._batches.empty():
                more = self._batches.get_nowait()
                if isinstance(more, BaseException):
                    failure = more
                else:
                    batch = [*batch, *more]
            yield batch
            if failure is not None:
                raise failure

    async def check_health(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the step loop failed: {self._error!r}")
        if not self._thread.is_alive():
            raise RuntimeError("the step loop is not running")
        await asyncio.get_running_loop().run_in_executor(None, self.engine.executor.check_health)

    def model_info(self) -> dict:
        engine = self.engine
        return {
            "model": engine.config.model,
            "model_path": engine.model_path,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.model_config.vocab_size,
            "max_logprobs": engine.config.max_logprobs,
            "num_gpu_blocks": engine.cache_sizes.num_gpu_blocks,
            "num_cpu_blocks": engine.cache_sizes.num_cpu_blocks,
            "block_size": engine.config.block_size,
            **engine.task_info,
        }

    def stats(self) -> dict:
        usage = self.engine.block_manager.usage()
        return {
            "num_unfinished_requests": self.engine.num_unfinished_requests(),
            "gpu_blocks_used": usage.gpu_used,
            "cpu_blocks_used": usage.cpu_used,
            "steps": self.timing.steps,
            "step_s": self.timing.step_s,
            "preemptions_recompute": self.engine.scheduler.counters.preemptions_recompute,
            "preemptions_swap": self.engine.scheduler.counters.preemptions_swap,
            "tier2_offloaded_blocks": self.engine.block_manager.counters.offloaded_blocks,
            "tier2_restored_blocks": self.engine.block_manager.counters.restored_blocks,
            "spec_decode_num_draft_tokens": self.engine.scheduler.counters.spec_decode_num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.engine.spec_decode_num_accepted_tokens,
            # per rank, (requests, sequences) in its persistent batch: (0, 0) when idle
            "worker_batch_states": self.engine.executor.batch_states(),
        }

    def engine_pressure(self) -> dict:
        """What the KV-pressure autoscaling policy needs, cumulative (single int reads of
        the engine's state, safe while the step thread runs)."""
        s = self.engine.scheduler
        return {
            "kv_usage": self.engine.block_manager.usage().gpu_usage,
            "num_waiting": len(s.waiting),
            "num_swapped": len(s.swapped),
            "num_preemptions": s.counters.preemptions_recompute + s.counters.preemptions_swap,
        }

    def prefix_cache_keys(self) -> list[int]:
        """Keys of the blocks this engine's prefix cache holds (what a fleet routes on)."""
        return self.engine.block_manager.cached_prefix_keys()

    def offload_prefix_keys(self) -> list[int]:
        """Keys of the blocks in this engine's prefix-cache tier 2 (host memory)."""
        return self.engine.block_manager.offload_prefix_keys()

    def resident_lora_ids(self) -> list[int]:
        """Int ids of the LoRA adapters in this engine's device slots (a fleet routes on them)."""
        slots = self.engine.lora_slots
        return [] if slots is None else [key[0] for key in slots.slot_of]

    async def metrics_text(self) -> str:
        """Prometheus exposition text of this replica's engine and GPU metrics."""
        return self.telemetry.metrics_text()

    def shutdown(self) -> None:
        self._alive = False
        self._wake.set()
        self._thread.join(timeout=10)
        self._lora_loader.shutdown(wait=False, cancel_futures=True)
        self.telemetry.shutdown()
        self.engine.executor.shutdown()

    # ------------------------------------------------------------------ internals

    def _attach_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._batches = asyncio.Queue()

    def _submit(self, op) -> None:
        self._ops.append(op)
        self._wake.set()

    def _publish(self, item) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._batches.put_nowait, item)

    def _apply_ops(self) -> None:
        while self._ops:
            kind, payload, done = self._ops.popleft()
            if kind in ("add", "call"):
                try:
                    result = self.engine.add_request(*payload) if kind == "add" else payload()
                except Exception as e:  # bad input: the caller gets the error, the loop goes on
                    done.set_exception(e)
                else:
                    done.set_result(result)
            elif kind == "stop":
                finished = self.engine.stop_sequences(*payload)
                if finished is not None:
                    self.telemetry.record_outputs([finished])
            elif self.engine.abort_request(payload):
                self.telemetry.record_aborted()

    def _poll_gpu(self) -> None:
        try:
            self.telemetry.update_gpu(self.engine.executor.gpu_snapshots())
        except Exception as e:  # telemetry never stops the step loop
            logger.warning("gathering GPU snapshots failed: %r", e)

    def _run(self, build, built: concurrent.futures.Future) -> None:
        try:
            build()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        was_busy = False
        first_step = 0.0
        try:
            while self._alive:
                self._apply_ops()
                if self.telemetry.is_gpu_poll_due():
                    self._poll_gpu()
                if not self.engine.has_unfinished_requests():
                    if was_busy:  # the steps' freed memory goes back to the system while idle
                        release_freed_memory()
                        was_busy = False
                    waited = time.perf_counter()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    if self.timing.steps:
                        self.timing.idle_s += time.perf_counter() - waited
                    continue
                was_busy = True
                start = time.perf_counter()
                outputs = self.engine.step()
                end = time.perf_counter()
                if not self.timing.steps:
                    first_step = start
                self.timing.steps += 1
                self.timing.step_s += end - start
                self.timing.span_s = end - first_step
                self.telemetry.record_outputs(outputs)
                if outputs:
                    self._publish(outputs)
        except BaseException as e:  # a worker died, a kernel failed: every waiter must hear it
            logger.exception("step loop failed")
            self._error = e
            failure = EngineUnavailable(f"the engine failed: {e!r}")
            while self._ops:
                _, _, done = self._ops.popleft()
                if done is not None:
                    done.set_exception(failure)
            self._publish(failure)
