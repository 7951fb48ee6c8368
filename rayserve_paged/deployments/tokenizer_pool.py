"""The replica's tokenizer threads: prompt encoding and chat templates run here, off the
event loop. One pool per replica, shared by the HTTP routes and the handle API, so the
number of threads and the work queued are those of the replica. Each job carries a weight
(the bytes of the request body it works on): the queue is bounded by what it costs, not
by how many jobs it holds."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

TOKENIZER_THREADS = 2


class TokenizerPool:
    def __init__(self, num_threads: int = TOKENIZER_THREADS) -> None:
        self.num_jobs = 0  # queued or running (a job outlives a caller that left)
        self.num_bytes = 0  # their weights
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tokenize")

    async def run(self, fn, num_bytes: int = 0):
        """`fn()` in a pool thread; its result (or exception) once done."""
        loop = asyncio.get_running_loop()
        self.num_jobs += 1
        self.num_bytes += num_bytes
        job = self._executor.submit(fn)
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._job_done, num_bytes))
        return await asyncio.wrap_future(job)

    def _job_done(self, num_bytes: int) -> None:
        self.num_jobs -= 1
        self.num_bytes -= num_bytes
