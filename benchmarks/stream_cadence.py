"""The gaps between a stream's events out of the replica's front end, without HTTP.

    python -m benchmarks.stream_cadence --interval-ms 0 --interval-ms 50 --streams 16

EngineFrontend (the LLMServer replica's front end: output processor, one DeltaBuffer per
request, `stream_batching_interval_ms`) over an LLMEngine that steps on a thread of its own,
as the scheduler actor steps in a process of its own: the engine's step outputs reach the
front end's event loop as they are made, and the readers run on that loop. The model is
`bench serving --launch ceiling`'s one-layer OPT of hidden 16 (a step costs almost
nothing), `--num-requests` requests of 16 prompt tokens and exactly `--output-len` output
tokens (greedy, ignore_eos), `--streams` of them in flight at all times. Per interval:
output tokens/s, events, and the gap between a stream's consecutive events as its reader
gets them (median, p99, max; pooled over requests), with the end-to-end time per request.
Each reader takes its events as fast as the loop lets it: what the gap shows beyond the
interval is the front end's own cadence and the loop's lateness, not the HTTP path's.
"""

from __future__ import annotations

import asyncio
import queue
import tempfile
import threading
import time

from benchmarks.metrics import latency_summary
from benchmarks.options import benchmark_parser
from benchmarks.records import load_average, write_record
from benchmarks.serving import (
    CEILING, CEILING_WORKLOAD, FIRST_TOKEN_ID, TOKEN_ID_LIMIT, engine_options, make_small_opt, small_opt_config,
)
from benchmarks.workloads import Workload, uniform_requests

DEFAULT_STREAMS = 16
DEFAULT_REQUESTS = 64


class ThreadedCore:
    """An LLMEngine stepping on its own thread; the front end's EngineCore.

    Requests, aborts and stops go to the thread through a queue (the engine is not
    thread-safe); each step's outputs come back onto the loop with call_soon_threadsafe."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._batches: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._batches = asyncio.Queue()
            self._thread = threading.Thread(target=self._run, name="engine-steps", daemon=True)
            self._thread.start()

    async def add_request(self, request_id, prompt, prompt_token_ids, params, lora_name=None) -> None:
        self._start()
        self._commands.put(lambda: self.engine.add_request(request_id, prompt, params,
                                                           prompt_token_ids=prompt_token_ids))

    async def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self.engine.abort_request(request_id))

    async def stop_sequences(self, request_id, stops) -> None:
        self._commands.put(lambda: self.engine.stop_sequences(request_id, stops))

    async def outputs(self):
        self._start()
        while True:
            yield await self._batches.get()

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished_requests()
            try:
                command = self._commands.get(timeout=0.01) if block else self._commands.get_nowait()
            except queue.Empty:
                command = None
            if command is not None:
                command()
                continue
            if not block:
                batch = self.engine.step()
                if batch:
                    self._loop.call_soon_threadsafe(self._batches.put_nowait, batch)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


async def measure(engine, tokenizer, requests, streams: int, interval_ms: float) -> dict:
    from rayserve_paged.core.sequence import SamplingParams
    from rayserve_paged.engine.frontend import EngineFrontend

    core = ThreadedCore(engine)
    frontend = EngineFrontend(core, tokenizer, stream_batching_interval_ms=interval_ms)
    loop = asyncio.get_running_loop()
    gaps, e2e, events, tokens = [], [], 0, 0
    pending = iter(enumerate(requests))

    async def one(i: int, request) -> None:
        nonlocal events, tokens
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        sent = last = loop.time()
        first = True
        async for out in frontend.generate_stream(request.prompt_token_ids, params, f"r{i}"):
            now = loop.time()
            if not first:
                gaps.append(now - last)
            first, last = False, now
            events += 1
            tokens += len(out.outputs[0].token_ids)
        e2e.append(loop.time() - sent)

    async def slot() -> None:
        for i, request in pending:
            await one(i, request)

    load_before, cpu0, t0 = load_average(), time.process_time(), time.perf_counter()
    try:
        await asyncio.gather(*(slot() for _ in range(streams)))
    finally:
        await frontend.close()
        core.close()
    seconds = time.perf_counter() - t0
    ms = lambda s: {k: None if v is None else round(v * 1000, 1) for k, v in s.items()}  # noqa: E731
    return {
        "interval_ms": interval_ms,
        "streams": streams,
        "seconds": round(seconds, 2),
        "output_tokens": tokens,
        "output_throughput": round(tokens / seconds, 1),
        "events": events,
        "cpu_seconds": round(time.process_time() - cpu0, 2),
        "gap_ms": {**ms(latency_summary(gaps)), "max": round(max(gaps) * 1000, 1) if gaps else None},
        "e2e_ms": ms(latency_summary(e2e)),
        "loadavg_before": load_before,
        "loadavg_after": load_average(),
    }


def run(args) -> list[dict]:
    from rayserve_paged.config import EngineConfig
    from rayserve_paged.engine.llm_engine import LLMEngine

    workload = Workload(num_requests=args.num_requests, min_prompt_len=CEILING_WORKLOAD.min_prompt_len,
                        max_prompt_len=CEILING_WORKLOAD.max_prompt_len, min_output_len=args.output_len,
                        max_output_len=args.output_len)  # fmt: skip
    requests = uniform_requests(workload, f"stream-cadence-{args.seed}", FIRST_TOKEN_ID, TOKEN_ID_LIMIT)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-cadence-") as tmp:
        model_dir, _ = make_small_opt(tmp, CEILING)
        # the served engine's options (`bench serving --launch ceiling`: one torch thread)
        engine = LLMEngine(EngineConfig(**engine_options(small_opt_config(model_dir, workload, 1, args.seed))))
        for _ in range(args.repeat):
            for interval_ms in args.interval_ms:
                record = asyncio.run(measure(engine, engine.tokenizer, requests, args.streams, interval_ms))
                print(format_record(record), flush=True)
                results.append(record)
    return results


def format_record(r: dict) -> str:
    g, e = r["gap_ms"], r["e2e_ms"]
    return (f"interval {r['interval_ms']:g} ms, {r['streams']} streams: {r['output_throughput']:.0f} tok/s, "
            f"{r['events']} events, gap median {g['median']} / p99 {g['p99']} / max {g['max']} ms, "
            f"E2E median {e['median']} ms, CPU {r['cpu_seconds']} s, "
            f"load {r['loadavg_before'][0]:.2f} -> {r['loadavg_after'][0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("python -m benchmarks.stream_cadence", __doc__.splitlines()[0],
                              out_help="directory for stream_cadence.json")  # fmt: skip
    parser.add_argument("--interval-ms", type=float, action="append", help="stream_batching_interval_ms "
                        "(repeatable; default 0 and 50)")  # fmt: skip
    parser.add_argument("--streams", type=int, default=DEFAULT_STREAMS)
    parser.add_argument("--num-requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--output-len", type=int, default=CEILING_WORKLOAD.max_output_len)
    parser.add_argument("--repeat", type=int, default=1, help="run the list of intervals this many times")
    args = parser.parse_args(argv)
    args.interval_ms = args.interval_ms or [0.0, 50.0]
    if args.quick:  # two streams of four short requests
        args.streams, args.num_requests, args.output_len = 2, 4, 8
    results = run(args)
    if args.out:
        print(write_record(args.out, "stream-cadence", {"runs": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
