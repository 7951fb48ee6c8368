"""Online serving over HTTP: latency and throughput of `POST /v1/completions` (streamed)
under Poisson arrivals and under a fixed number of requests in flight.

    rayserve-paged bench serving --url http://127.0.0.1:8000 --rate 1 --rate 2 --max-concurrency 16 --out DIR
    rayserve-paged bench serving --launch small-opt --compare-in-process --out DIR      # one command

Load. Each run sends the same request set: request i leaves at arrival_times[i], where the
gaps are exponential with mean 1 / rate (Poisson arrivals; the same seeded gaps, scaled, at
every rate), or as soon as one of C slots is free (`--max-concurrency C`: C requests always
in flight). Every request streams (`stream: true`, `stream_options.include_usage`), greedy,
`ignore_eos: true`, so its output has exactly max_tokens tokens. Prompts are token ids,
random in the tiny tokenizer's non-special range (valid for any vocabulary of >= 512).
Lengths, uniform and inclusive: prompt 16..128 tokens, max_tokens 16..96 (--quick: 4..16
and 2..8).

Per request, on the client's clock:
    TTFT   send -> the first event that carries a choice
    E2E    send -> `data: [DONE]`
    TPOT   (E2E - TTFT) / (output tokens - 1), for requests of at least 2 output tokens
    ITL    the gaps between consecutive events that carry a choice (pooled over requests;
           an event may carry several tokens, so with coalescing ITL is per event)
    output tokens: `usage.completion_tokens` of the final usage event (the events that
    carried a choice when the server sends no usage)
Per run: request throughput = completed requests / run seconds, output-token throughput =
their output tokens / run seconds (first send -> last answer), and the mean, median and p99
(linear interpolation) of each latency. A failure is a non-200 answer, an error event, a
stream without [DONE], or a request past --timeout.

--launch CONFIG.yaml starts a Ray head (`ray start --head --num-cpus=2`) and `serve run
CONFIG` (HTTP moved to a free loopback port) as subprocesses, waits for /health, runs the
load, and stops both: SIGTERM to `serve run`, then SIGTERM and, after a grace period, SIGKILL
to the head's process group (only the Ray processes this run started: `ray stop` would stop
every Ray cluster on the machine). `--launch small-opt` first writes the small random-weight
OPT of the throughput benchmark (6 layers, hidden 512, ffn 2048) to a temporary directory and
a Serve config for it: one LLMServer replica (which also serves HTTP), no autoscaling,
worker 1.0 CPU, scheduler and replica 0.1 CPU each, `num_cpu_threads` = --threads.
`--launch ceiling` does the same with a one-layer OPT of hidden size 16 (a step costs almost
nothing: the serving path is what is measured), 256 requests of 16 prompt and exactly 256
output tokens, at 16 and 64 in flight and all at once, compared in-process; it also writes
serving_concurrency.png (output tokens/s against requests in flight). With --launch:
`--stream-interval N` sets the app's stream_interval, `--stream-batching-interval-ms T`
its stream_batching_interval_ms; `--direct-ingress` starts the cluster
with RAY_SERVE_ENABLE_DIRECT_INGRESS=1 and the replica's HTTP port pinned to a free one, and
sends the load there (Serve's proxy off the path); `--serve-env NAME=VALUE` sets any other
variable in the launched cluster's environment.

--compare-in-process (with --launch) runs the same requests all at once through
`LLM.generate` in this process, with the config's engine options (a config without
`num_cpu_threads` gets the worker actor's OMP_NUM_THREADS: its CPUs, at least 1), before the
server starts and again after it stops, and over HTTP all at once in between:
`http_over_in_process` = HTTP output tokens/s / the mean of the two in-process runs (other
processes share the CPUs, so the bracket shows how much the machine's load moved). CPU
seconds of every process of the launched cluster (worker, scheduler actor, replicas, proxy,
raylet ...) and of this client are read from /proc around each run: where the time goes.
The small OPT runs with one torch thread by default (--threads): the worker gets one core,
Serve, Ray and the client the other.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from benchmarks.metrics import latency_summary
from benchmarks.options import benchmark_parser
from benchmarks.records import load_average, progress, write_report
from benchmarks.workloads import Request, Workload, uniform_requests

DEFAULT_SEED = 0
DEFAULT_RATES = (1.0, 2.0, 4.0)
DEFAULT_MAX_CONCURRENCY = 16
DEFAULT_THREADS = 1
DEFAULT_TIMEOUT_S = 600.0
LAUNCH_NUM_CPUS = 2
SMALL_OPT = "small-opt"  # --launch small-opt: the throughput benchmark's OPT, generated
CEILING = "ceiling"  # --launch ceiling: a one-layer OPT of hidden 16 whose step costs almost nothing
CEILING_MODEL = {
    "num_hidden_layers": 1,
    "hidden_size": 16,
    "word_embed_proj_dim": 16,
    "num_attention_heads": 2,
    "ffn_dim": 64,
    "max_position_embeddings": 512,
}
CEILING_CONCURRENCY = (16, 64)  # and all at once: 256 streams
TARGET_RATIO = 0.8  # HTTP output tokens/s over the in-process engine's, same requests
FIRST_TOKEN_ID = 7  # the tiny tokenizer's ids 0..6 are special tokens
TOKEN_ID_LIMIT = 512  # exclusive: the tiny tokenizer's vocabulary
MAX_ERRORS_KEPT = 5
SHUTDOWN_GRACE_S = 10.0
CLIENT_LABEL = "load client (this process)"


# ---------------------------------------------------------------------------- workload


FULL = Workload(num_requests=32, min_prompt_len=16, max_prompt_len=128, min_output_len=16, max_output_len=96)
QUICK = Workload(num_requests=6, min_prompt_len=4, max_prompt_len=16, min_output_len=2, max_output_len=8)
CEILING_WORKLOAD = Workload(num_requests=256, min_prompt_len=16, max_prompt_len=16, min_output_len=256,
                            max_output_len=256)
WARMUP = Workload(num_requests=2, min_prompt_len=8, max_prompt_len=8, min_output_len=4, max_output_len=4)


def make_requests(workload: Workload, seed: int) -> list[Request]:
    """Prompt and output lengths uniform on [min, max] (inclusive), random token ids."""
    return uniform_requests(workload, f"serving-requests-{seed}", FIRST_TOKEN_ID, TOKEN_ID_LIMIT)


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: 0, then exponential gaps of mean 1 / rate.

    The gaps are drawn with rate 1 and divided by `rate`, so every rate replays the same
    seeded schedule, compressed. rate = inf: every request at 0."""
    if rate <= 0:
        raise ValueError(f"rate: must be > 0 (got {rate})")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(f"serving-arrivals-{seed}")
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(1.0) / rate
    return times


# ---------------------------------------------------------------------------- SSE, per request


DONE = "[DONE]"


class SSEDecoder:
    """Server-sent events, one line at a time (without its line break): feed() returns an
    event's data when the blank line that ends it arrives. Several `data:` lines of one event
    are joined with newlines; comments (`:`) and other fields are skipped."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r")
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The data of an event cut off by the end of the stream, if any."""
        return self.feed("")


@dataclass(slots=True)
class RequestResult:
    is_ok: bool
    prompt_len: int
    output_len: int  # asked for (max_tokens)
    num_output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between the events carrying a choice

    @property
    def tpot_s(self) -> float | None:
        if not self.is_ok or self.num_output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


class StreamTracker:
    """Accounting of one streamed completion from its event payloads and their arrival
    times (seconds since the request was sent). No I/O: the tests feed it directly."""

    def __init__(self, prompt_len: int, output_len: int) -> None:
        self.result = RequestResult(is_ok=False, prompt_len=prompt_len, output_len=output_len)
        self.num_choice_events = 0
        self.last_choice_t: float | None = None
        self.usage_tokens: int | None = None
        self.is_done = False

    def on_event(self, payload: str, t: float) -> None:
        if payload == DONE:
            self.is_done = True
            self.result.e2e_s = t
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            self.result.error = self.result.error or f"not JSON: {payload[:80]!r}"
            return
        if "error" in event:
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self.result.error = self.result.error or f"error event: {message}"
            return
        if event.get("choices"):
            self.num_choice_events += 1
            if self.result.ttft_s is None:
                self.result.ttft_s = t
            if self.last_choice_t is not None:
                self.result.itl_s.append(t - self.last_choice_t)
            self.last_choice_t = t
        if event.get("usage"):
            self.usage_tokens = event["usage"].get("completion_tokens")

    def finish(self) -> RequestResult:
        r = self.result
        if r.error is None and not self.is_done:
            r.error = "the stream ended without [DONE]"
        if r.error is None and r.ttft_s is None:
            r.error = "no choice in the stream"
        r.is_ok = r.error is None
        r.num_output_tokens = self.usage_tokens if self.usage_tokens is not None else self.num_choice_events
        return r


# ---------------------------------------------------------------------------- statistics


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """A run's figures from its requests and its wall seconds (first send -> last answer)."""
    ok = [r for r in results if r.is_ok]
    num_output_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_failures": len(results) - len(ok),
        "num_length_mismatches": sum(1 for r in ok if r.num_output_tokens != r.output_len),
        "duration_s": duration_s,
        "num_prompt_tokens": sum(r.prompt_len for r in ok),
        "num_output_tokens": num_output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": num_output_tokens / duration_s,
        "ttft_s": latency_summary([r.ttft_s for r in ok]),
        "tpot_s": latency_summary([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": latency_summary([gap for r in ok for gap in r.itl_s]),
        "e2e_s": latency_summary([r.e2e_s for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:MAX_ERRORS_KEPT],
    }


# ---------------------------------------------------------------------------- load over HTTP


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One load pattern: Poisson at `request_rate` (inf = all at once), at most
    `max_concurrency` in flight (None = no limit)."""

    request_rate: float
    max_concurrency: int | None = None

    @property
    def mode(self) -> str:
        if self.max_concurrency is not None:
            return "concurrency"
        return "all-at-once" if math.isinf(self.request_rate) else "poisson"

    @property
    def name(self) -> str:
        if self.mode == "concurrency":
            return f"C={self.max_concurrency}"
        return "all at once" if self.mode == "all-at-once" else f"{self.request_rate:g} req/s"


def completion_body(model: str, request: Request, **extra) -> dict:
    return {
        **extra,
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_request(client: httpx.AsyncClient, base_url: str, model: str, request: Request,
                       timeout_s: float, **extra) -> RequestResult:
    """One streamed completion; `extra`: more body fields (e.g. `user`)."""
    tracker = StreamTracker(len(request.prompt_token_ids), request.output_len)
    start = time.perf_counter()

    async def stream() -> None:
        body = completion_body(model, request, **extra)
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                tracker.result.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            decoder = SSEDecoder()
            async for line in response.aiter_lines():
                payload = decoder.feed(line)
                if payload is not None:
                    tracker.on_event(payload, time.perf_counter() - start)
            tail = decoder.flush()
            if tail is not None:
                tracker.on_event(tail, time.perf_counter() - start)

    try:
        await asyncio.wait_for(stream(), timeout_s)
    except asyncio.TimeoutError:
        tracker.result.error = f"no answer within --timeout {timeout_s:g} s"
    except httpx.HTTPError as e:
        tracker.result.error = f"{type(e).__name__}: {e}"
    return tracker.finish()


async def run_load(client: httpx.AsyncClient, base_url: str, model: str, requests: list[Request], spec: RunSpec,
                   seed: int, timeout_s: float) -> tuple[list[RequestResult], float]:
    """Send every request on its schedule; (results in request order, run seconds)."""
    times = arrival_times(len(requests), spec.request_rate, seed)
    slots = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None  # FIFO
    start = time.perf_counter()

    async def one(request: Request, at: float) -> RequestResult:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is None:
            return await send_request(client, base_url, model, request, timeout_s)
        async with slots:
            return await send_request(client, base_url, model, request, timeout_s)

    results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, times)))
    return list(results), time.perf_counter() - start


def make_client(max_connections: int, timeout_s: float, api_key: str | None = None) -> httpx.AsyncClient:
    """One client for the whole benchmark: a connection per request in flight, no proxies."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        headers=headers,
        trust_env=False,
    )


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def measure_http(base_url: str, model: str | None, requests: list[Request], specs: list[RunSpec], seed: int,
                       timeout_s: float, api_key: str | None, cpu_root: int | None,
                       log=print) -> tuple[str, list[dict]]:
    """Warm up, then every run in turn over one shared client; (model name, run records)."""
    async with make_client(max(len(requests), 16), timeout_s, api_key) as client:
        model = model or await served_model(client, base_url)
        warmup, _ = await run_load(client, base_url, model, make_requests(WARMUP, seed + 1),
                                   RunSpec(math.inf), seed, timeout_s)
        if not all(r.is_ok for r in warmup):
            raise RuntimeError(f"warm-up requests failed: {[r.error for r in warmup]}")
        runs = []
        for spec in specs:
            load_before = load_average()
            cpu_before = cpu_seconds_by_process(cpu_root) if cpu_root is not None else None
            client_cpu = time.process_time()
            results, seconds = await run_load(client, base_url, model, requests, spec, seed, timeout_s)
            client_cpu = time.process_time() - client_cpu
            record = {"name": spec.name, "mode": spec.mode,
                      "request_rate": None if math.isinf(spec.request_rate) else spec.request_rate,
                      "max_concurrency": spec.max_concurrency, **summarize(results, seconds),
                      "loadavg_before": load_before, "loadavg_after": load_average()}
            if cpu_before is not None:
                spent = {**cpu_delta(cpu_before, cpu_seconds_by_process(cpu_root)), CLIENT_LABEL: round(client_cpu, 2)}
                record["cpu_seconds"] = dict(sorted(spent.items(), key=lambda kv: -kv[1]))
            runs.append(record)
            log(f"  {spec.name}: {record['num_completed']}/{record['num_requests']} in {seconds:.1f} s, "
                f"{record['output_throughput']:.1f} output tok/s, load {load_average()[0]:.2f}")
    return model, runs


# ---------------------------------------------------------------------------- CPU seconds from /proc


def _proc_stat(pid: int) -> tuple[int, int, float, int] | None:
    """(ppid, pgid, user + system CPU seconds, start time in ticks) of a live process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is the state (field 3)
    if fields[0] == "Z":
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[1]), int(fields[2]), (int(fields[11]) + int(fields[12])) / ticks, int(fields[19])


def _process_label(pid: int) -> str:
    """`ray::WorkerActor` for Ray workers (their title, task name cut), else the program."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = b" ".join(argv).decode(errors="replace").split()
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0].split(".")[0]
    program = os.path.basename(words[0])
    if program.startswith("python") and len(words) > 1:
        rest = words[1:]
        while rest and rest[0] in ("-u", "-m"):
            rest = rest[1:]
        return os.path.basename(rest[0]) if rest else program
    return program


def cluster_pids(pgid: int) -> list[int]:
    """The processes of a process group and all their descendants (Ray's workers leave the
    head's group: they are found as the raylet's children)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _proc_stat(int(entry))) is not None:
            table[int(entry)] = stat
    members = {pid for pid, (_, group, _, _) in table.items() if group == pgid}
    grew = True
    while grew:
        children = {pid for pid, (ppid, _, _, _) in table.items() if ppid in members} - members
        members |= children
        grew = bool(children)
    return sorted(members)


def cpu_seconds_by_process(pgid: int) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, start ticks) -> (label, CPU seconds so far) for the group and its descendants."""
    snapshot = {}
    for pid in cluster_pids(pgid):
        stat = _proc_stat(pid)
        if stat is not None:
            snapshot[(pid, stat[3])] = (_process_label(pid), stat[2])
    return snapshot


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds spent between two snapshots, summed per label, most first."""
    spent: dict[str, float] = {}
    for key, (label, seconds) in after.items():
        spent[label] = spent.get(label, 0.0) + seconds - before.get(key, (label, 0.0))[1]
    return dict(sorted(((k, round(v, 2)) for k, v in spent.items() if v >= 0.005), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------- --launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def small_opt_config(model_dir: str, workload: Workload, threads: int, seed: int) -> dict:
    """A Serve config (YAML as a dict) for the small OPT on a 2-core CPU: one fixed LLMServer
    replica whose KV pool holds every request at full length at once (no preemption)."""
    from benchmarks.throughput import kv_cache_gb

    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": [{
            "name": "llm",
            "route_prefix": "/",
            "import_path": "rayserve_paged.app:build_app",
            "args": {
                "model": model_dir,
                "served_model_name": os.path.basename(model_dir),
                "device": "cpu",
                "dtype": "float32",
                "block_size": 16,
                "max_model_len": 512,
                "kv_cache_memory_gb": kv_cache_gb(workload, model_dir),
                "swap_space_gb": 0.1,
                "enable_prefix_caching": False,  # random prompts share nothing
                "num_cpu_threads": threads,
                "seed": seed,
                "num_replicas": 1,
                "max_ongoing_requests": max(256, workload.num_requests),
                "ray_actor_options": {"num_cpus": 0.1},
                "scheduler_cpus": 0.1,
                "worker_cpus": 1.0,
            },
        }],
    }  # fmt: skip


def make_small_opt(out_dir: str, name: str = SMALL_OPT) -> tuple[str, dict]:
    """The throughput benchmark's OPT (or, for `ceiling`, the one-layer OPT of hidden 16; random
    weights, seed 0) in out_dir; (path, its shape)."""
    from benchmarks.throughput import FULL as THROUGHPUT_FULL
    from rayserve_paged.models.tiny import make_tiny_model

    overrides = CEILING_MODEL if name == CEILING else THROUGHPUT_FULL.model
    return str(make_tiny_model("opt", os.path.join(out_dir, name), **overrides)), dict(overrides)


def with_http_port(config: dict, port: int) -> dict:
    return {**config, "http_options": {**config.get("http_options", {}), "host": "127.0.0.1", "port": port}}


def with_app_args(config: dict, **app_args) -> dict:
    """The config with these arguments set on its (first) application."""
    first, *rest = config["applications"]
    return {**config, "applications": [{**first, "args": {**first.get("args", {}), **app_args}}, *rest]}


def engine_options(config: dict) -> dict:
    """EngineConfig fields of the (single) application in a Serve config, as its worker
    runs them: without `num_cpu_threads` the worker actor's torch uses the OMP_NUM_THREADS
    Ray gives it (its CPUs, at least 1), so the in-process engine gets the same."""
    from rayserve_paged.app import AppArgs, engine_config_of

    apps = config["applications"]
    if len(apps) != 1:
        raise ValueError(f"expected one application in the Serve config, found {len(apps)}")
    args = AppArgs(**apps[0].get("args", {}))
    options = engine_config_of(args).model_dump()
    if options["num_cpu_threads"] is None:
        options["num_cpu_threads"] = max(1, int(args.worker_cpus))
    return options


class LaunchedServer:
    """A Ray head and `serve run CONFIG` as subprocesses, on free loopback ports.

    Shutdown stops only what this object started: `serve run` by its pid, then the head's
    process group (gcs, raylet, agents: `ray start` runs in a session of its own) with
    SIGTERM and, after SHUTDOWN_GRACE_S, SIGKILL; the Ray workers die with their raylet."""

    def __init__(self, config: dict, log_dir: Path, num_cpus: int = LAUNCH_NUM_CPUS,
                 serve_env: dict[str, str] | None = None, direct_ingress: bool = False) -> None:
        self.port = free_port()
        self.config = with_http_port(config, self.port)
        self.log_dir = log_dir
        self.num_cpus = num_cpus
        self.env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **(serve_env or {}))
        if direct_ingress:  # the replica listens itself, on a port pinned here; the proxy is off the path
            replica_port = free_port()
            self.env.update(RAY_SERVE_ENABLE_DIRECT_INGRESS="1", RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(replica_port),
                            RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(replica_port + 1))
            self.port = replica_port
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.ray_pgid: int | None = None
        self.serve: subprocess.Popen | None = None
        self._logs: list = []
        self._previous_sigterm = None

    def start(self, timeout_s: float, log=print) -> None:
        import yaml

        self.log_dir.mkdir(parents=True, exist_ok=True)
        gcs_port = free_port()
        head = subprocess.Popen(
            [_bin("ray"), "start", "--head", f"--port={gcs_port}", f"--num-cpus={self.num_cpus}", "--num-gpus=0",
             "--include-dashboard=false", "--disable-usage-stats", f"--ray-client-server-port={free_port()}"],
            env=self.env, stdout=self._log("ray_start.log"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.ray_pgid = head.pid  # the session leader's pid names the group
        if head.wait(timeout=120) != 0:
            raise RuntimeError(f"ray start failed ({head.returncode}); see {self.log_dir / 'ray_start.log'}")
        config_path = self.log_dir / "serve_config.yaml"
        config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.serve = subprocess.Popen(
            [_bin("serve"), "run", str(config_path)], env=dict(self.env, RAY_ADDRESS=f"127.0.0.1:{gcs_port}"),
            stdout=self._log("serve_run.log"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        log(f"  ray head 127.0.0.1:{gcs_port}, serve run on {self.base_url}; logs in {self.log_dir}")
        self._wait_healthy(timeout_s)

    def _log(self, name: str):
        f = open(self.log_dir / name, "w")
        self._logs.append(f)
        return f

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(trust_env=False, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.serve.poll() is not None:
                    raise RuntimeError(f"serve run exited with {self.serve.returncode}; see {self.log_dir}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                time.sleep(1)
        raise RuntimeError(f"{self.base_url}/health not OK after {timeout_s:g} s; see {self.log_dir}")

    def stop(self) -> None:
        pids = cluster_pids(self.ray_pgid) if self.ray_pgid is not None else []
        if self.serve is not None and self.serve.poll() is None:
            self.serve.send_signal(signal.SIGTERM)
            try:
                self.serve.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.serve.kill()
                self.serve.wait()
        if self.ray_pgid is not None:
            _signal_group(self.ray_pgid, signal.SIGTERM)
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            while cluster_pids(self.ray_pgid) and time.monotonic() < deadline:
                time.sleep(0.5)
            _signal_group(self.ray_pgid, signal.SIGKILL)
            for pid in pids:  # workers outside the group that outlived their raylet
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        for f in self._logs:
            f.close()

    def __enter__(self) -> LaunchedServer:
        # a SIGTERM to the benchmark must still stop the cluster: make it unwind like Ctrl-C
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# ---------------------------------------------------------------------------- in-process engine


class InProcessEngine:
    """LLM.generate in this process with the served engine's options: every request at once."""

    def __init__(self, options: dict, seed: int) -> None:
        from rayserve_paged import LLM

        self.llm = LLM(**options)
        self._generate(make_requests(WARMUP, seed + 1))  # untimed

    def _generate(self, requests: list[Request]) -> int:
        from rayserve_paged import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        outputs = self.llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def measure(self, requests: list[Request]) -> dict:
        load_before, cpu0, t0 = load_average(), time.process_time(), time.perf_counter()
        num_output_tokens = self._generate(requests)
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        return {
            "seconds": seconds,
            "num_output_tokens": num_output_tokens,
            "output_throughput": num_output_tokens / seconds,
            "request_throughput": len(requests) / seconds,
            "cpu_seconds": round(cpu_s, 2),  # this process: the engine and its torch threads
            "loadavg_before": load_before,
            "loadavg_after": load_average(),
        }


def compare(in_process_runs: list[dict], http: dict) -> dict:
    """HTTP all at once against the in-process runs that bracket it in time (their mean
    throughput), and the CPU seconds each spent per 1000 output tokens."""
    in_process = sum(r["output_throughput"] for r in in_process_runs) / len(in_process_runs)
    ratio = http["output_throughput"] / in_process
    num_tokens = sum(r["num_output_tokens"] for r in in_process_runs)
    cpu_in_process = sum(r["cpu_seconds"] for r in in_process_runs) / num_tokens
    comparison = {
        "in_process_output_throughput": in_process,
        "http_output_throughput": http["output_throughput"],
        "http_over_in_process": ratio,
        "http_over_each_in_process_run": [http["output_throughput"] / r["output_throughput"] for r in in_process_runs],
        "target_ratio": TARGET_RATIO,
        "target_met": ratio >= TARGET_RATIO,
        "cpu_seconds_per_1k_output_tokens": {"in_process": 1e3 * cpu_in_process, "http": None},
    }
    if http.get("cpu_seconds"):
        total = sum(http["cpu_seconds"].values())
        comparison["cpu_seconds_per_1k_output_tokens"]["http"] = 1e3 * total / http["num_output_tokens"]
    return comparison


# ---------------------------------------------------------------------------- report


def _ms(summary: dict, key: str) -> str:
    value = summary[key]
    return f"{value * 1e3:7.0f}" if value is not None else f"{'-':>7}"


def format_table(runs: list[dict]) -> str:
    header = (f"{'run':>12} {'ok':>4} {'fail':>4} {'sec':>6} {'req/s':>6} {'out tok/s':>9} |"
              f" {'TTFT ms mean':>12} {'med':>7} {'p99':>7} | {'TPOT ms mean':>12} {'med':>7} {'p99':>7} |"
              f" {'ITL ms med':>10} {'p99':>7} |"
              f" {'E2E ms mean':>11} {'med':>7} {'p99':>7}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for r in runs:
        lines.append(
            f"{r['name']:>12} {r['num_completed']:4d} {r['num_failures']:4d} {r['duration_s']:6.1f} "
            f"{r['request_throughput']:6.2f} {r['output_throughput']:9.1f} |"
            f" {_ms(r['ttft_s'], 'mean'):>12} {_ms(r['ttft_s'], 'median')} {_ms(r['ttft_s'], 'p99')} |"
            f" {_ms(r['tpot_s'], 'mean'):>12} {_ms(r['tpot_s'], 'median')} {_ms(r['tpot_s'], 'p99')} |"
            f" {_ms(r['itl_s'], 'median'):>10} {_ms(r['itl_s'], 'p99')} |"
            f" {_ms(r['e2e_s'], 'mean'):>11} {_ms(r['e2e_s'], 'median')} {_ms(r['e2e_s'], 'p99')}"
        )
    return "\n".join(lines)


def format_report(result: dict) -> str:
    cfg, machine = result["config"], result["machine"]
    w = cfg["workload"]
    lines = [
        f"{w['num_requests']} requests per run: prompts uniform {w['min_prompt_len']}-{w['max_prompt_len']}, "
        f"max_tokens uniform {w['min_output_len']}-{w['max_output_len']} tokens, greedy, ignore_eos, streamed; "
        f"model {cfg['model']!r} at {cfg['url']}",
        f"machine: {machine['cpu_count']} CPUs ({machine['cpu']}), load average before "
        f"{_load(cfg['loadavg_before'])}, after {_load(cfg['loadavg_after'])}",
        "",
        format_table(result["runs"]),
    ]
    failures = [e for r in result["runs"] for e in r["errors"]]
    if failures:
        lines += ["", "errors (first of each kind): " + "; ".join(failures[:MAX_ERRORS_KEPT])]
    compared = result["in_process"]
    if compared is not None:
        http = next(r for r in result["runs"] if r["mode"] == "all-at-once")
        lines.append("")
        for when, r in zip(("before the server", "after the server"), compared["runs"]):
            lines.append(
                f"in-process LLM.generate, same requests all at once, {when}: {r['seconds']:.1f} s, "
                f"{r['output_throughput']:.1f} output tok/s, {r['cpu_seconds']:.1f} CPU s "
                f"(load {_load(r['loadavg_before'])} -> {_load(r['loadavg_after'])})"
            )
        cpu = compared["cpu_seconds_per_1k_output_tokens"]
        lines += [
            f"HTTP all at once: {http['duration_s']:.1f} s, {http['output_throughput']:.1f} output tok/s",
            f"http_over_in_process: {compared['http_over_in_process']:.2f} (against the mean of the in-process runs; "
            + ", ".join(f"{x:.2f}" for x in compared["http_over_each_in_process_run"])
            + f" against each)  [{'PASS' if compared['target_met'] else 'FAIL'}] target >= {TARGET_RATIO:g}",
        ]
        if cpu["http"] is not None:
            spent = ", ".join(f"{k} {v:.1f}" for k, v in http["cpu_seconds"].items() if v >= 0.05)
            lines += [
                f"CPU seconds per 1000 output tokens: in-process {cpu['in_process']:.1f}, HTTP (every process of "
                f"the cluster + this client) {cpu['http']:.1f}",
                f"CPU seconds during the HTTP all-at-once run ({http['duration_s']:.1f} s wall): {spent}",
            ]
    return "\n".join(lines)


def _load(loadavg: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in loadavg)


def plot(runs: list[dict], path: str, provenance: str | None = None) -> None:
    """Latency percentiles over request rate; `provenance` (commit and machine) under the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    poisson = sorted((r for r in runs if r["mode"] == "poisson"), key=lambda r: r["request_rate"])
    others = [r for r in runs if r["mode"] != "poisson"]
    panels = (("ttft_s", "TTFT (ms)", 1e3), ("tpot_s", "TPOT (ms)", 1e3), ("e2e_s", "end-to-end latency (s)", 1.0))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, label, scale) in zip(axes, panels):
        for stat, style in (("median", "-o"), ("p99", "--s")):
            points = [(r["request_rate"], r[key][stat] * scale) for r in poisson if r[key][stat] is not None]
            if points:
                ax.plot(*zip(*points), style, label=f"Poisson, {stat}")
        for r in others:  # placed at the request rate they achieved
            for stat, marker in (("median", "^"), ("p99", "v")):
                if r[key][stat] is not None:
                    ax.plot(r["request_throughput"], r[key][stat] * scale, marker, label=f"{r['name']}, {stat}")
        ax.set_xlabel("request rate (req/s): offered (Poisson), achieved (others)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    title = "rayserve-paged over HTTP: latency against request rate (streamed /v1/completions)"
    fig.suptitle(f"{title}\n({provenance})" if provenance else title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_concurrency(result: dict, path: str) -> None:
    """Streamed output tokens/s against requests in flight (all at once = every request),
    with the in-process engine's figure on the same requests as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(
        (r["max_concurrency"] or r["num_requests"], r["output_throughput"])
        for r in result["runs"]
        if r["mode"] in ("concurrency", "all-at-once")
    )
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(*zip(*points), "-o", label="HTTP, streamed (client-side)")
    if result["in_process"] is not None:
        ax.axhline(result["in_process"]["in_process_output_throughput"], color="gray", linestyle="--",
                   label="in-process LLM.generate, all at once")
    ax.set_xscale("log", base=2)
    ax.set_xticks([c for c, _ in points], [str(c) for c, _ in points])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"serving path: tokens/s against concurrency ({result['config']['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- the run


def run_specs(rates: list[float] | None, max_concurrency: list[int] | None, compare: bool) -> list[RunSpec]:
    if not rates and not max_concurrency:
        rates, max_concurrency = list(DEFAULT_RATES), [DEFAULT_MAX_CONCURRENCY]
    specs = [RunSpec(rate) for rate in sorted(rates or [])] + [RunSpec(math.inf, c) for c in max_concurrency or []]
    if compare and RunSpec(math.inf) not in specs:
        specs.insert(0, RunSpec(math.inf))  # next to the in-process run in time
    return specs


def _launch_config(launch: str, tmp: str, workload: Workload, threads: int, seed: int) -> tuple[dict, dict | None]:
    """(Serve config, the generated model's shape or None) for --launch."""
    import yaml

    if launch in (SMALL_OPT, CEILING):
        model_dir, shape = make_small_opt(tmp, launch)
        return small_opt_config(model_dir, workload, threads, seed), shape
    return yaml.safe_load(Path(launch).read_text()), None


def run(args, workload: Workload, log=print) -> dict:
    specs = run_specs(args.rate, args.max_concurrency, args.compare_in_process)
    requests = make_requests(workload, args.seed)
    loadavg_before = load_average()
    in_process_runs, serve_config, model_shape = [], None, None
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        if args.launch is None:
            model, runs = asyncio.run(measure_http(args.url.rstrip("/"), args.model, requests, specs, args.seed,
                                                   args.timeout, args.api_key, None, log))  # fmt: skip
            url = args.url
        else:
            serve_config, model_shape = _launch_config(args.launch, tmp, workload, args.threads, args.seed)
            if args.stream_interval is not None:
                serve_config = with_app_args(serve_config, stream_interval=args.stream_interval)
            if args.stream_batching_interval_ms is not None:
                serve_config = with_app_args(serve_config, stream_batching_interval_ms=args.stream_batching_interval_ms)
            engine = None
            if args.compare_in_process:  # before the server starts and after it stops
                engine = InProcessEngine(engine_options(serve_config), args.seed)
                in_process_runs.append(_measure_in_process(engine, requests, log))
            with LaunchedServer(serve_config, Path(args.out) / "launch", args.num_cpus, dict(args.serve_env or []),
                                args.direct_ingress) as server:
                server.start(args.launch_timeout, log)
                model, runs = asyncio.run(measure_http(server.base_url, args.model, requests, specs, args.seed,
                                                       args.timeout, args.api_key, server.ray_pgid, log))
                url, serve_config = server.base_url, server.config
            if engine is not None:
                in_process_runs.append(_measure_in_process(engine, requests, log))
    result = {"runs": runs, "in_process": None}
    if in_process_runs:
        comparison = compare(in_process_runs, next(r for r in runs if r["mode"] == "all-at-once"))
        result["in_process"] = {"runs": in_process_runs, **comparison}
        result.update(http_over_in_process=comparison["http_over_in_process"], target_met=comparison["target_met"])
    result["config"] = {
        "url": url,
        "model": model,
        "model_shape": model_shape,
        "launch": args.launch,
        "serve_config": serve_config,
        "serve_env": dict(args.serve_env or []),
        "direct_ingress": args.direct_ingress,
        "engine_options": engine_options(serve_config) if serve_config else None,
        "workload": asdict(workload),
        "length_distribution": "prompt and max_tokens uniform on [min, max] inclusive; random token ids in "
                               f"[{FIRST_TOKEN_ID}, {TOKEN_ID_LIMIT}); greedy, ignore_eos",
        "arrivals": "Poisson: exponential gaps of mean 1/rate from one seeded sequence; concurrency: C in flight",
        "request_ids_order": "every run sends the same requests in the same order",
        "seed": args.seed,
        "timeout_s": args.timeout,
        "quick": args.quick,
        "loadavg_before": loadavg_before,
        "loadavg_after": load_average(),
    }  # fmt: skip
    return result


def _measure_in_process(engine: InProcessEngine, requests: list[Request], log) -> dict:
    log("  in-process LLM.generate, every request at once ...")
    record = engine.measure(requests)
    log(f"  in-process: {record['seconds']:.1f} s, {record['output_throughput']:.1f} output tok/s, "
        f"load {load_average()[0]:.2f}")
    return record


def _positive_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return rate


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (got {text!r})")
    return name, value


def _parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("rayserve-paged bench serving", __doc__.splitlines()[0], out_required=True,
                              out_help="directory for serving.json and serving.png", seed=DEFAULT_SEED,
                              quick_help="seconds, for tests: a few short requests")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch", metavar="CONFIG.yaml",
                        help=f"start Ray + `serve run CONFIG.yaml` here first ('{SMALL_OPT}' / '{CEILING}': a generated "
                             f"model and config; '{CEILING}' defaults to 256 streams of 256 tokens at 16, 64, 256 "
                             "in flight, compared in-process)")
    parser.add_argument("--rate", type=_positive_rate, action="append",
                        help="Poisson request rate in req/s (repeat; 'inf' = all at once)")
    parser.add_argument("--max-concurrency", type=int, action="append",
                        help="a run with this many requests always in flight (repeat)")
    parser.add_argument("--num-requests", type=int, default=None, help=f"per run (default {FULL.num_requests})")
    parser.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    parser.add_argument("--compare-in-process", action="store_true",
                        help="with --launch: the same requests through LLM.generate in this process")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"num_cpu_threads of the generated {SMALL_OPT} config (default {DEFAULT_THREADS})")
    parser.add_argument("--num-cpus", type=int, default=LAUNCH_NUM_CPUS, help="CPUs of the launched Ray head")
    parser.add_argument("--serve-env", type=_env_pair, action="append", metavar="NAME=VALUE",
                        help="with --launch: an environment variable for the launched Ray cluster (repeat), "
                             "e.g. RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0")
    parser.add_argument("--stream-interval", type=int, default=None,
                        help="with --launch: the app's stream_interval (tokens per SSE event; default: the config's)")
    parser.add_argument("--stream-batching-interval-ms", type=float, default=None,
                        help="with --launch: the app's stream_batching_interval_ms (a stream's events at most once "
                             "per this many ms; default: the config's)")
    parser.add_argument("--direct-ingress", action="store_true",
                        help="with --launch: RAY_SERVE_ENABLE_DIRECT_INGRESS=1, and the load goes to the replica's "
                             "own HTTP port instead of Serve's proxy")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    parser.add_argument("--launch-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    return parser  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_concurrency and min(args.max_concurrency) < 1:
        parser.error("--max-concurrency must be >= 1")
    if args.compare_in_process and args.launch is None:
        parser.error("--compare-in-process needs --launch (the engine options come from its config)")
    if args.stream_interval is not None and args.stream_interval < 1:
        parser.error("--stream-interval must be >= 1")
    if args.stream_batching_interval_ms is not None and not 0 <= args.stream_batching_interval_ms < math.inf:
        parser.error("--stream-batching-interval-ms must be >= 0 and finite")
    if args.threads < 1 or args.timeout <= 0:
        parser.error("--threads and --timeout must be positive")
    if args.launch == CEILING and not args.rate and not args.max_concurrency:
        args.max_concurrency = list(CEILING_CONCURRENCY)  # all at once (256) is added with the comparison
        args.compare_in_process = True
    workload = QUICK if args.quick else CEILING_WORKLOAD if args.launch == CEILING else FULL
    if args.num_requests is not None:
        if args.num_requests < 1:
            parser.error("--num-requests must be >= 1")
        workload = replace(workload, num_requests=args.num_requests)
    os.makedirs(args.out, exist_ok=True)
    result = run(args, workload, log=progress)
    plots = [os.path.join(args.out, "serving.png")]
    plot(result["runs"], plots[0])
    if any(r["mode"] == "concurrency" for r in result["runs"]):
        plots.append(os.path.join(args.out, "serving_concurrency.png"))
        plot_concurrency(result, plots[-1])
    write_report(args.out, "serving.json", result, format_report, *plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
