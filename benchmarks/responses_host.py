"""Host cost of a streamed /v1/responses answer against the same request over
/v1/chat/completions: CPU seconds per 1k output tokens, one sitting, runs interleaved.

    rayserve-paged bench responses-host --out DIR

The OpenAI app (create_openai_app) over the replica's front end (EngineFrontend) and an
LLMEngine stepping on a thread of its own (stream_cadence.ThreadedCore), serving
`bench serving --launch ceiling`'s one-layer OPT of hidden 16 (a step costs almost
nothing): what the CPU time shows is the serving path's own cost. Each request is called
on the ASGI app directly (no sockets, no HTTP client; the body's bytes are counted and
dropped), `--streams` in flight at a time, `--num-requests` per run, each exactly
`--output-len` tokens (greedy, ignore_eos) from the same chat prompt. With
stream_batching_interval_ms 0 and stream_interval 1 every engine step is an event: the
most events per token a stream can have, where a richer event costs most. Two CPU
figures: the process's (all threads: the engine's steps, the event loop, the tokenizer
pool), and the event loop thread's alone (the routes, the front end's detokenizing and
the events; the engine steps on its own thread), where the routes differ.

    rayserve-paged bench responses-host --store --out DIR

instead times what a continuation's lookup costs: a conversation of `--turns` turns kept in
the replica's ResponseStore (put, then get and parse), against the same bytes kept in a Ray
actor and fetched with one remote call (the shared store `routing: prefix` could use
instead of the session rule; a local Ray instance of two CPUs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time

from benchmarks.records import load_average, write_json
from benchmarks.serving import CEILING, CEILING_WORKLOAD, engine_options, make_small_opt, small_opt_config
from benchmarks.stream_cadence import ThreadedCore
from benchmarks.workloads import Workload

ROUTES = ("chat", "responses")
PROMPT = "Tell me a long story about the sea."
_USAGE = {"chat": re.compile(rb'"completion_tokens":(\d+)'), "responses": re.compile(rb'"output_tokens":(\d+)')}


def request_body(route: str, model: str, output_len: int) -> tuple[str, bytes]:
    common = {"model": model, "temperature": 0, "ignore_eos": True, "stream": True}
    if route == "chat":
        body = {**common, "messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": output_len,
                "stream_options": {"include_usage": True}}  # fmt: skip
        return "/v1/chat/completions", json.dumps(body).encode()
    body = {**common, "input": PROMPT, "max_output_tokens": output_len, "store": False}
    return "/v1/responses", json.dumps(body).encode()


async def call(app, path: str, body: bytes) -> tuple[int, int, bytes]:
    """(status, body bytes, the body's last 4 KiB) of one request on the ASGI app."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "server": ("bench", 80), "client": ("bench", 1)}  # fmt: skip
    sent = False
    connected = asyncio.Event()  # never set: the client stays until the answer ends
    status, num_bytes, tail = 0, 0, b""

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await connected.wait()

    async def send(message):
        nonlocal status, num_bytes, tail
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            tail = (tail + chunk)[-4096:]

    await app(scope, receive, send)
    return status, num_bytes, tail


async def measure(app, route: str, model: str, num_requests: int, streams: int, output_len: int) -> dict:
    path, body = request_body(route, model, output_len)
    pending = iter(range(num_requests))
    tokens = num_bytes = 0

    async def slot() -> None:
        nonlocal tokens, num_bytes
        for _ in pending:
            status, size, tail = await call(app, path, body)
            if status != 200:
                raise RuntimeError(f"{route}: HTTP {status}: {tail[-300:]!r}")
            tokens += int(_USAGE[route].findall(tail)[-1])
            num_bytes += size

    load_before, cpu0, loop0, t0 = load_average(), time.process_time(), time.thread_time(), time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(streams)))
    cpu, loop_cpu, seconds = time.process_time() - cpu0, time.thread_time() - loop0, time.perf_counter() - t0
    return {
        "route": route,
        "streams": streams,
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu, 3),
        "cpu_s_per_1k_tokens": round(1000 * cpu / tokens, 4),
        "loop_cpu_seconds": round(loop_cpu, 3),
        "loop_cpu_s_per_1k_tokens": round(1000 * loop_cpu / tokens, 4),
        "bytes_per_token": round(num_bytes / tokens, 1),
        "loadavg_before": load_before,
        "loadavg_after": load_average(),
    }


async def sitting(args) -> list[dict]:
    from rayserve_paged.config import EngineConfig
    from rayserve_paged.deployments.openai_ingress import create_openai_app
    from rayserve_paged.engine.frontend import EngineFrontend
    from rayserve_paged.engine.llm_engine import LLMEngine

    workload = Workload(num_requests=args.num_requests, min_prompt_len=CEILING_WORKLOAD.min_prompt_len,
                        max_prompt_len=CEILING_WORKLOAD.max_prompt_len, min_output_len=args.output_len,
                        max_output_len=args.output_len)  # fmt: skip
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-responses-") as tmp:
        model_dir, _ = make_small_opt(tmp, CEILING)
        engine = LLMEngine(EngineConfig(**engine_options(small_opt_config(model_dir, workload, 1, args.seed))))
        core = ThreadedCore(engine)
        frontend = EngineFrontend(core, engine.tokenizer)

        async def model_info() -> dict:
            return {"model": "ceiling", "max_model_len": engine.max_model_len, "max_logprobs": 0,
                    "vocab_size": engine.model_config.vocab_size}  # fmt: skip

        frontend.model_info = model_info
        app = create_openai_app(frontend, engine.tokenizer, "ceiling", max_pending_requests=1024)
        try:
            for route in ROUTES:  # warm-up: templates, pools, first steps
                await measure(app, route, "ceiling", args.streams, args.streams, 8)
            for _ in range(args.repeat):
                for route in ROUTES:
                    record = await measure(app, route, "ceiling", args.num_requests, args.streams, args.output_len)
                    print(format_record(record), flush=True)
                    records.append(record)
        finally:
            await frontend.close()
            core.close()
    return records


def measure_store(turns: int, repeat: int) -> dict:
    """Microseconds per lookup: the local store against a Ray actor holding the same bytes."""
    import ray

    from rayserve_paged.deployments.serving.response_store import ResponseStore, StoredResponse

    turn = [{"id": f"msg_{i:032x}", "type": "message", "role": "user" if i % 2 else "assistant",
             "content": [{"type": "input_text", "text": "a sentence of a conversation " * 4}], "status": "completed"}
            for i in range(2 * turns)]  # fmt: skip
    response_json = json.dumps({"id": "resp_x", "output": turn[-1:]}).encode()
    conversation_json = json.dumps(turn).encode()
    store = ResponseStore()
    t0 = time.perf_counter()
    for i in range(repeat):
        store.put(f"resp_{i}", StoredResponse(response_json, conversation_json, 1, "resp_0"))
    put_us = (time.perf_counter() - t0) / repeat * 1e6
    t0 = time.perf_counter()
    for i in range(repeat):
        entry = store.get(f"resp_{i}")
        json.loads(entry.conversation_json)
    get_us = (time.perf_counter() - t0) / repeat * 1e6

    @ray.remote(num_cpus=0)
    class SharedStore:
        def __init__(self):
            self.entries = {}

        def put(self, key, value):
            self.entries[key] = value

        def get(self, key):
            return self.entries.get(key)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = SharedStore.remote()
        ray.get(actor.put.remote("warm", conversation_json))
        t0 = time.perf_counter()
        for i in range(repeat):
            ray.get(actor.put.remote(f"resp_{i}", conversation_json))
        actor_put_us = (time.perf_counter() - t0) / repeat * 1e6
        t0 = time.perf_counter()
        for i in range(repeat):
            json.loads(ray.get(actor.get.remote(f"resp_{i}")))
        actor_get_us = (time.perf_counter() - t0) / repeat * 1e6
    finally:
        ray.shutdown()
    return {"turns": turns, "conversation_bytes": len(conversation_json), "repeat": repeat,
            "local_put_us": round(put_us, 1), "local_get_us": round(get_us, 1),
            "actor_put_us": round(actor_put_us, 1), "actor_get_us": round(actor_get_us, 1),
            "loadavg": load_average()}  # fmt: skip


def summarize(records: list[dict]) -> dict:
    summary = {}
    for key in ("cpu_s_per_1k_tokens", "loop_cpu_s_per_1k_tokens"):
        medians = {r: statistics.median(x[key] for x in records if x["route"] == r) for r in ROUTES}
        summary[key] = {"median": medians, "ratio": round(medians["responses"] / medians["chat"], 3)}
    return summary


def format_record(r: dict) -> str:
    return (f"{r['route']:>9}: {r['output_tokens']} tokens in {r['seconds']} s, CPU {r['cpu_seconds']} s = "
            f"{r['cpu_s_per_1k_tokens']:.4f} s per 1k tokens (event loop {r['loop_cpu_s_per_1k_tokens']:.4f}), "
            f"{r['bytes_per_token']} bytes per token, "
            f"load {r['loadavg_before'][0]:.2f} -> {r['loadavg_after'][0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="chat, responses, chat, ... this many times each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store", action="store_true", help="time a continuation's lookup instead (above)")
    parser.add_argument("--turns", type=int, default=10, help="--store: turns in the stored conversation")
    parser.add_argument("--out", help="write the records and their summary as JSON in this directory")
    args = parser.parse_args(argv)
    if args.store:
        record = measure_store(args.turns, 200 * args.repeat)
        print(json.dumps(record))
        if args.out:
            write_json(args.out, "responses_store.json", record)
        return 0
    records = asyncio.run(sitting(args))
    summary = summarize(records)
    print(json.dumps(summary))
    if args.out:
        write_json(args.out, "responses_host.json", {"args": vars(args), "records": records, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
