"""An EngineClient over a real LLMEngine in this process, for the ingress tests.

The same EngineFrontend the LLMServer replica runs (output processor, per-request delta
buffers, stop strings sent back to the engine) over an in-process core: one stepping task
per event loop runs `engine.step()` while requests are unfinished and hands each step's
batch of deltas to the front end. Steps run on the loop itself (tens of milliseconds on
the tiny model), so everything is single-threaded and deterministic.
"""

from __future__ import annotations

import asyncio

from rayserve_paged.engine.frontend import EngineFrontend, cancel_and_wait
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.telemetry import ReplicaTelemetry, TelemetryConfig


class InProcessCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.aborted: list[str] = []
        self._batches: asyncio.Queue | None = None
        self._wakeup: asyncio.Event | None = None
        self._stepper: asyncio.Task | None = None

    async def add_request(self, request_id, prompt, prompt_token_ids, params, lora_name=None) -> None:
        self._start()
        grammar = self.engine.compile_constraint(params)  # as the SchedulerActor: before the step
        self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids, lora_request=lora_name,
                                grammar=grammar)
        self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.engine.abort_request(request_id)

    async def stop_sequences(self, request_id, stops) -> None:
        self.engine.stop_sequences(request_id, stops)

    async def outputs(self):
        self._start()  # idempotent: add_request may have started it first
        while True:
            yield await self._batches.get()

    def _start(self) -> None:
        if self._stepper is None or self._stepper.done():
            self._batches = asyncio.Queue()
            self._wakeup = asyncio.Event()
            self._stepper = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self.engine.step()
            if batch:
                self._batches.put_nowait(batch)
            # let the HTTP side run between steps; a real pause, not sleep(0): anyio
            # cancels a task only while the future it waits on is pending, and a stepper
            # that refills the queue every loop iteration would never leave it pending
            await asyncio.sleep(0.001)

    async def close(self) -> None:
        if self._stepper is not None:
            await cancel_and_wait(self._stepper)
            self._stepper = None


class InProcessEngineClient(EngineFrontend):
    def __init__(
        self, engine: LLMEngine, model_name: str, stream_interval: int = 1, stream_batching_interval_ms: float = 0.0
    ) -> None:
        super().__init__(InProcessCore(engine), engine.tokenizer, stream_interval, stream_batching_interval_ms)
        self.engine = engine
        self.model_name = model_name
        self.is_healthy = True
        self.telemetry = ReplicaTelemetry(engine, TelemetryConfig(replica="test-replica"))

    @property
    def aborted(self) -> list[str]:
        return self.core.aborted

    async def model_info(self) -> dict:
        if not self.is_healthy:
            raise RuntimeError("engine down")
        return {
            "model": self.model_name,
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.model_config.vocab_size,
            "max_logprobs": self.engine.config.max_logprobs,
            **self.engine.task_info,
        }

    async def metrics_text(self) -> str:
        return self.telemetry.metrics_text()

    async def lora_adapters(self) -> dict[str, str]:
        return {name: lora.lora_path for name, lora in self.engine.loras.items()}

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.engine.load_lora(name, path)

    async def unload_lora_adapter(self, name: str) -> bool:
        return self.engine.remove_lora(name)

    async def close(self) -> None:
        await super().close()
        await self.core.close()
