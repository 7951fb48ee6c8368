"""Load: a burst of simultaneous requests, or a sustained open-loop overload, against a
running server (`serve run configs/...yaml`), and what came back.

    rayserve-paged bench load --launch configs/smollm2.yaml --burst 1000 --out DIR
    rayserve-paged bench load --launch configs/tiny.yaml --rate 200 --duration-s 30 --out DIR
    rayserve-paged bench load --url http://127.0.0.1:8000 ...        (a server already running)

--launch starts a Ray head and `serve run CONFIG` on free loopback ports (as `bench serving
--launch`), waits for /health, and stops both at the end.

Every request is a short chat (`--kind chat`, "Hi" and --max-tokens) or completion; all
of a burst are sent at once (one connection each, as `--request-rate inf` clients do); a
sustained run sends --rate requests per second (Poisson arrivals) for --duration-s. After
either, --after sequential requests check that the server answers normally.

Each answer is one of: ok (200, the whole answer: finish_reason set), shed (503 with a
Retry-After header and an OpenAI error body: ours), serve-503 (503 without them: Serve's
own text 503), other-<status>, or error (no HTTP answer: the connection failed or timed
out). Reported: the counts, p50 / p99 latency of the ok ones, the Retry-After values seen,
the wall time of the burst or run, and whether every --after request was ok.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from benchmarks.records import load_average, write_json


def classify(response: httpx.Response) -> str:
    if response.status_code == 200:
        try:
            choices = response.json()["choices"]
        except (ValueError, KeyError):
            return "other-200"
        return "ok" if choices and all(c.get("finish_reason") for c in choices) else "other-200"
    if response.status_code == 503:
        try:
            is_ours = set(response.json()["error"]) >= {"message", "type", "code"}
        except (ValueError, KeyError, TypeError):
            is_ours = False
        return "shed" if is_ours and "retry-after" in response.headers else "serve-503"
    return f"other-{response.status_code}"


def body_of(kind: str, model: str, max_tokens: int) -> tuple[str, dict]:
    if kind == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    return "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": max_tokens, "temperature": 0}


async def _one(client: httpx.AsyncClient, path: str, body: dict, results: list) -> None:
    start = time.perf_counter()
    try:
        response = await client.post(path, json=body)
        outcome = classify(response)
        retry_after = response.headers.get("retry-after")
    except httpx.HTTPError:
        outcome, retry_after = "error", None
    results.append((outcome, time.perf_counter() - start, retry_after))


async def run(args, url: str) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.timeout_s, connect=args.timeout_s)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, trust_env=False) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        path, body = body_of(args.kind, model, args.max_tokens)
        results: list = []
        start = time.perf_counter()
        if args.burst:
            await asyncio.gather(*(_one(client, path, body, results) for _ in range(args.burst)))
        else:
            rng = random.Random(args.seed)
            tasks = []
            deadline = start + args.duration_s
            due = start  # arrivals on the clock: a late wake-up sends every request already due
            while due < deadline:
                now = time.perf_counter()
                while due <= now and due < deadline:
                    tasks.append(asyncio.ensure_future(_one(client, path, body, results)))
                    due += rng.expovariate(args.rate)
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await asyncio.gather(*tasks)
        wall_s = time.perf_counter() - start
        after: list = []
        for _ in range(args.after):
            await _one(client, path, body, after)
    counts = Counter(outcome for outcome, _, _ in results)
    ok_s = sorted(s for outcome, s, _ in results if outcome == "ok")
    retry = Counter(r for outcome, _, r in results if outcome == "shed")
    return {
        "mode": f"burst {args.burst}" if args.burst else f"{args.rate:g} req/s for {args.duration_s:g} s",
        "kind": args.kind,
        "max_tokens": args.max_tokens,
        "requests": len(results),
        "outcomes": dict(sorted(counts.items())),
        "ok_p50_s": round(statistics.median(ok_s), 3) if ok_s else None,
        "ok_p99_s": round(ok_s[min(len(ok_s) - 1, int(0.99 * len(ok_s)))], 3) if ok_s else None,
        "retry_after_s": dict(sorted(retry.items(), key=lambda kv: int(kv[0]))),
        "wall_s": round(wall_s, 2),
        "after_ok": f"{sum(o == 'ok' for o, _, _ in after)}/{len(after)}",
        "load_average": load_average(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayserve-paged bench load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--launch", type=Path, default=None, help="a Serve config to start (then --url is unused)")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--kind", choices=("chat", "completion"), default="chat")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--burst", type=int, default=0, help="requests sent at once (0: a sustained run)")
    parser.add_argument("--rate", type=float, default=100.0, help="sustained: requests per second")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--after", type=int, default=10, help="sequential requests afterwards")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.burst == 0 and args.rate <= 0:
        parser.error("--rate must be > 0")
    if args.launch is None:
        record = asyncio.run(run(args, args.url))
    else:
        import yaml

        from benchmarks.serving import LaunchedServer

        with LaunchedServer(yaml.safe_load(args.launch.read_text()), args.out / "launch") as server:
            server.start(timeout_s=600)
            record = asyncio.run(run(args, server.base_url))
        record["config"] = str(args.launch)
    print(json.dumps(record))
    write_json(args.out, "load.json", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
