"""Fleet routing: `routing: load` against `routing: prefix` on LLMServer replicas (two by default), under
a multi-turn chat workload with shared system prompts.

    rayserve-paged bench fleet-routing --out DIR            (python -m benchmarks.fleet_routing)

Each mode gets a fresh cluster (`ray start --head` + `serve run`, as `bench serving
--launch`): the small OPT of the throughput benchmark (6 layers, hidden 512), --replicas replicas
with one torch thread each, prefix caching on.

Workload (seeded, the same for both modes): --systems system prompts of --system-len tokens;
--users conversations, user i on system prompt i mod systems, all at once, each a closed
loop of --turns turns (with --think-s, a random pause after each answer). Turn t's prompt is the system prompt, then per earlier turn a user
message (--message-len tokens) and a reply (--reply-len tokens: a fixed random stand-in for
the model's answer, so prompts are known in advance), then turn t's message. Every request
streams --max-tokens tokens (greedy, ignore_eos) and sends `user` (its session). Random
token ids in the tiny tokenizer's range. First, one-token requests of unrelated tokens until
every replica has answered one (the cluster is healthy once one replica is).

The KV pool (--kv-blocks per replica, 288 by default) holds the workload's distinct blocks
(4 x 256 system tokens and 16 x 4 x 64 conversation tokens: 320 blocks) once across the
fleet but not in each replica: under `load` every replica sees every conversation and the
LRU evicts, under `prefix` each holds its own share. (Too big a pool hides what routing
buys past the first hits; too small a pool preempts.)

In the closed loop (--think-s 0) Serve's queue-length choice tends to send a conversation's
next turn back to the replica that has just answered it (its queue has just shrunk by one),
so `load` keeps many conversations together by accident. With --think-s each user pauses
after an answer, as people do; the next turn then arrives at a moment unrelated to the last
answer, and `load` places it by the queues of that moment.

Figures per mode: fleet prefix-cache hit rate (the replicas' own hit / query token
counters, summed over the fleet, over the measured run), per-replica hit rates, TTFT
p50 / p99 and E2E p50 on the client's clock, output tokens/s over the run; with prefix,
the routing decisions by reason and the router's own time per decision (its
routing_step_seconds / routing_steps counters: queue lengths, the rule). The ingress's
key computation (prefix_block_keys of each prompt) is timed here, in this process, on the
workload's own prompts. Then --probe-requests sequential one-token requests of 8 unique
tokens each measure what one request costs end to end in each mode at no load (the prefix
mode's extra hop and routing step, against the one-hop app).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.records import load_average, write_json
from benchmarks.serving import (
    FIRST_TOKEN_ID,
    TOKEN_ID_LIMIT,
    LaunchedServer,
    Request,
    latency_summary,
    make_client,
    make_small_opt,
    send_request,
    small_opt_config,
    summarize,
)
from benchmarks.serving import Workload as ServingWorkload

MODES = ("load", "prefix")
TARGET_HIT_RATIO = 1.8  # prefix hit rate over load's
def launch_num_cpus(replicas: int) -> int:
    """Logical CPUs of the Ray head: 1.0 per replica (worker 0.8 + replica and scheduler) and one
    for the ingress and the proxy (3 for the default two replicas), on the machine's 2 cores."""
    return replicas + 1
BLOCK_SIZE = 16


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, TOKEN_ID_LIMIT) for _ in range(n)]


def conversations(args) -> list[list[list[int]]]:
    """conversations[user][turn] = that turn's prompt (token ids)."""
    rng = random.Random(args.seed)
    systems = [_tokens(rng, args.system_len) for _ in range(args.systems)]
    out = []
    for user in range(args.users):
        history = list(systems[user % args.systems])
        turns = []
        for _ in range(args.turns):
            history += _tokens(rng, args.message_len)
            turns.append(list(history))
            history += _tokens(rng, args.reply_len)
        out.append(turns)
    return out


def serve_config(model_dir: str, args, routing: str) -> dict:
    max_len = args.system_len + args.turns * (args.message_len + args.reply_len) + args.max_tokens
    workload = ServingWorkload(args.users * args.turns, max_len, max_len, args.max_tokens, args.max_tokens)
    config = small_opt_config(model_dir, workload, threads=1, seed=args.seed)
    app_args = config["applications"][0]["args"]
    app_args.update(
        enable_prefix_caching=True, max_model_len=max(512, max_len), num_replicas=args.replicas, worker_cpus=0.8,
        routing=routing, metrics_cache_s=0, num_gpu_blocks_override=args.kv_blocks,
    )  # fmt: skip
    return config


def scrape(client: httpx.Client, base_url: str) -> dict[str, dict[tuple, float]]:
    """Counter totals by family, keyed by their labels (sorted (name, value) pairs)."""
    text = client.get(f"{base_url}/metrics").raise_for_status().text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_total"):
                out.setdefault(family.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _delta(after: dict, before: dict, family: str) -> dict[tuple, float]:
    a, b = after.get(family, {}), before.get(family, {})
    return {labels: value - b.get(labels, 0.0) for labels, value in a.items()}


def _by(delta: dict[tuple, float], label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in delta.items():
        key = dict(labels)[label]
        out[key] = out.get(key, 0.0) + value
    return out


def think_times(args) -> list[list[float]]:
    """think[user][turn] = seconds the user waits after turn's answer before the next turn
    (exponential, mean --think-s; all 0 with --think-s 0, the closed loop)."""
    rng = random.Random(args.seed + 1)
    return [[rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0.0 for _ in range(args.turns)]
            for _ in range(args.users)]  # fmt: skip


async def chat(base_url: str, model: str, prompts: list[list[list[int]]], max_tokens: int, timeout_s: float,
               think: list[list[float]]):  # fmt: skip
    """Every conversation at once, each turn after the previous one's answer (and the user's think time)."""

    async with make_client(len(prompts) + 4, timeout_s) as client:

        async def conversation(user: int):
            results = []
            for turn, prompt in enumerate(prompts[user]):
                if turn and think[user][turn - 1]:
                    await asyncio.sleep(think[user][turn - 1])
                request = Request(prompt, max_tokens)
                results.append(await send_request(client, base_url, model, request, timeout_s, user=f"user-{user}"))
            return results

        start = time.perf_counter()
        per_user = await asyncio.gather(*(conversation(u) for u in range(len(prompts))))
        return [r for results in per_user for r in results], time.perf_counter() - start


async def probe(base_url: str, model: str, num: int, seed: int, timeout_s: float) -> dict:
    """`num` sequential one-token requests of 8 unique tokens: latency at no load."""
    rng = random.Random(seed + 7)
    async with make_client(2, timeout_s) as client:
        results = [await send_request(client, base_url, model, Request(_tokens(rng, 8), 1), timeout_s)
                   for _ in range(num)]  # fmt: skip
    return latency_summary([r.e2e_s for r in results if r.is_ok]) | {"num_failed": sum(not r.is_ok for r in results)}


def warm_up(client: httpx.Client, base_url: str, model: str, timeout_s: float, replicas: int = 2) -> None:
    """One-token requests of unrelated tokens until every replica has answered one (/health
    is OK once one replica is up; the others may still be loading)."""
    rng = random.Random(12345)
    deadline = time.monotonic() + timeout_s
    while True:
        body = {"model": model, "prompt": _tokens(rng, 8), "max_tokens": 1}
        client.post(f"{base_url}/v1/completions", json=body).raise_for_status()
        finished = _by(scrape(client, base_url).get("rayserve_paged_request_finished", {}), "replica")
        if len([n for n in finished.values() if n > 0]) >= replicas:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {sorted(finished)} of {replicas} replicas answered within {timeout_s:g} s")
        time.sleep(0.5)


def keys_time_us(prompts: list[list[list[int]]]) -> float:
    """Mean microseconds of prefix_block_keys over the workload's prompts (the ingress's part)."""
    from rayserve_paged.core.block_manager import prefix_block_keys

    flat = [p for turns in prompts for p in turns]
    start = time.perf_counter()
    repeats = 20
    for _ in range(repeats):
        for p in flat:
            prefix_block_keys(p, BLOCK_SIZE)
    return (time.perf_counter() - start) / (repeats * len(flat)) * 1e6


def measure_mode(model_dir: str, routing: str, prompts, args, log) -> dict:
    config = serve_config(model_dir, args, routing)
    with LaunchedServer(config, Path(args.out) / f"launch-{routing}", launch_num_cpus(args.replicas)) as server:
        server.start(args.launch_timeout, log)
        model = os.path.basename(model_dir)
        with httpx.Client(trust_env=False, timeout=60) as client:
            warm_up(client, server.base_url, model, args.launch_timeout, args.replicas)
            before = scrape(client, server.base_url)
            load_before = load_average()
            think = think_times(args)
            results, seconds = asyncio.run(chat(server.base_url, model, prompts, args.max_tokens, args.timeout, think))
            load_after = load_average()
            after = scrape(client, server.base_url)
        probe_e2e = asyncio.run(probe(server.base_url, model, args.probe_requests, args.seed, args.timeout))
    hits = _by(_delta(after, before, "rayserve_paged_prefix_cache_hits"), "replica")
    queries = _by(_delta(after, before, "rayserve_paged_prefix_cache_queries"), "replica")
    record = {
        "routing": routing,
        **summarize(results, seconds),
        "fleet_hit_rate": sum(hits.values()) / max(1.0, sum(queries.values())),
        "hit_rate_by_replica": {r: hits.get(r, 0.0) / max(1.0, q) for r, q in sorted(queries.items())},
        "hit_tokens": sum(hits.values()),
        "query_tokens": sum(queries.values()),
        "probe_e2e_s": probe_e2e,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }
    if routing == "prefix":
        record["decisions"] = _by(_delta(after, before, "rayserve_paged_routing_decisions"), "reason")
        step_s = sum(_delta(after, before, "rayserve_paged_routing_step_seconds").values())
        steps = sum(_delta(after, before, "rayserve_paged_routing_steps").values())
        record["router_us_per_decision"] = step_s / steps * 1e6 if steps else None
    log(f"  {routing}: {record['num_completed']}/{record['num_requests']} in {seconds:.1f} s, "
        f"hit rate {record['fleet_hit_rate']:.3f}, TTFT p50 {record['ttft_s']['median'] * 1e3:.0f} ms")
    return record


def format_report(result: dict) -> str:
    runs = {r["routing"]: r for r in result["runs"]}
    lines = [
        "| routing | fleet hit rate | per replica | TTFT p50 | TTFT p99 | E2E p50 | output tok/s "
        "| one request, idle (p50) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        r = runs[mode]
        per = " / ".join(f"{v:.3f}" for v in r["hit_rate_by_replica"].values())
        lines.append(
            f"| {mode} | {r['fleet_hit_rate']:.3f} | {per} | {r['ttft_s']['median'] * 1e3:.0f} ms | "
            f"{r['ttft_s']['p99'] * 1e3:.0f} ms | {r['e2e_s']['median'] * 1e3:.0f} ms | "
            f"{r['output_throughput']:.1f} | {r['probe_e2e_s']['median'] * 1e3:.1f} ms |"
        )
    p = runs["prefix"]
    lines += [
        "",
        f"hit rate prefix / load: {result['hit_ratio']:.2f} (target >= {TARGET_HIT_RATIO}); "
        f"TTFT p50 prefix / load: {result['ttft_p50_ratio']:.2f} (target < 1)",
        f"prefix decisions: {json.dumps({k: int(v) for k, v in sorted(p['decisions'].items())})}; "
        f"router {p['router_us_per_decision']:.0f} us per decision; ingress keys "
        f"{result['keys_us_per_request']:.0f} us per request",
    ]
    return "\n".join(lines)


def run(args, log) -> dict:
    prompts = conversations(args)
    loadavg_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-routing-") as tmp:
        model_dir, shape = make_small_opt(tmp)
        runs = [measure_mode(model_dir, mode, prompts, args, log) for mode in MODES]
    load, prefix = runs
    return {
        "runs": runs,
        "hit_ratio": prefix["fleet_hit_rate"] / load["fleet_hit_rate"] if load["fleet_hit_rate"] else float("inf"),
        "ttft_p50_ratio": prefix["ttft_s"]["median"] / load["ttft_s"]["median"],
        "keys_us_per_request": keys_time_us(prompts),
        "config": {
            "workload": {k: getattr(args, k) for k in
                         ("systems", "system_len", "users", "turns", "message_len", "reply_len", "max_tokens",
                          "kv_blocks", "think_s", "replicas")},
            "model_shape": shape, "seed": args.seed, "launch_num_cpus": launch_num_cpus(args.replicas),
            "loadavg_before": loadavg_before, "loadavg_after": load_average(),
        },
    }  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayserve-paged bench fleet-routing", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for fleet_routing.json and the launch logs")
    parser.add_argument("--systems", type=int, default=4, help="shared system prompts")
    parser.add_argument("--system-len", type=int, default=256, help="tokens per system prompt")
    parser.add_argument("--users", type=int, default=16, help="conversations, all at once")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--message-len", type=int, default=32, help="tokens per user message")
    parser.add_argument("--reply-len", type=int, default=32, help="tokens of each earlier reply in the prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--kv-blocks", type=int, default=288,
                        help="KV blocks per replica (num_gpu_blocks_override): the workload's blocks fit once in the "
                             "fleet, not in each replica")
    parser.add_argument("--replicas", type=int, default=2, help="LLMServer replicas in each mode")
    parser.add_argument("--think-s", type=float, default=0.0,
                        help="mean seconds (exponential) a user waits after an answer before the next turn; 0: a "
                             "closed loop, each turn right after the previous answer")
    parser.add_argument("--probe-requests", type=int, default=32, help="sequential one-token requests per mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--launch-timeout", type=float, default=600.0, help="seconds for the cluster to be healthy")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = run(args, lambda m: print(m, file=sys.stderr, flush=True))
    write_json(args.out, "fleet_routing.json", result)  # with the machine record (platform, CPU, versions)
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
