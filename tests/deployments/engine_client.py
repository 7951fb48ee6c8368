"""An EngineClient over a real LLMEngine in this process, for the ingress tests.

One stepping task per event loop runs `engine.step()` while requests are unfinished and
hands each RequestOutput to its request's queue. Steps run on the loop itself (tens of
milliseconds on the tiny model), so everything is single-threaded and deterministic.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.engine.llm_engine import LLMEngine
from rayserve_paged.engine.outputs import RequestOutput
from rayserve_paged.telemetry import ReplicaTelemetry, TelemetryConfig


class InProcessEngineClient:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.aborted: list[str] = []
        self.is_healthy = True
        self.telemetry = ReplicaTelemetry(engine, TelemetryConfig(replica="test-replica"))
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._stepper: asyncio.Task | None = None

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str
    ) -> RequestOutput:
        last = None
        async for last in self.generate_stream(prompt, sampling_params, request_id):
            pass
        return last

    async def generate_stream(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        self._start()
        if isinstance(prompt, str):
            self.engine.add_request(request_id, prompt, sampling_params)
        else:
            self.engine.add_request(request_id, None, sampling_params, prompt_token_ids=prompt)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._wakeup.set()
        try:
            while True:
                output = await queue.get()
                yield output
                if output.finished:
                    return
        finally:
            self._queues.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.engine.abort_request(request_id)

    async def model_info(self) -> dict:
        if not self.is_healthy:
            raise RuntimeError("engine down")
        return {
            "model": self.model_name,
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.model_config.vocab_size,
            "max_logprobs": self.engine.config.max_logprobs,
        }

    async def metrics_text(self) -> str:
        return self.telemetry.metrics_text()

    async def close(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            try:
                await self._stepper
            except asyncio.CancelledError:
                pass
            self._stepper = None

    def _start(self) -> None:
        if self._stepper is None or self._stepper.done():
            self._wakeup = asyncio.Event()
            self._stepper = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            for output in self.engine.step():
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            # let the HTTP side run between steps; a real pause, not sleep(0): anyio
            # cancels a task only while the future it waits on is pending, and a stepper
            # that refills the queue every loop iteration would never leave it pending
            await asyncio.sleep(0.001)
