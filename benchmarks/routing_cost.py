"""The cost of one routing decision of `routing: prefix` (AffinityPolicy.choose) against the
number of replicas and the keys each caches.

    rayserve-paged bench routing-cost --out DIR          (python -m benchmarks.routing_cost)

Tied queues (an idle or evenly loaded fleet: the tie-break decides), each replica
publishing --keys cached keys (a frozenset, as replicas report them) and sent a tenth as
many more; a prompt no replica holds. The median of several decisions per case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.records import write_json


def fleet(num_replicas: int, num_keys: int):
    from rayserve_paged.deployments.routing import AffinityPolicy, RoutingKey

    policy = AffinityPolicy()
    for i in range(num_replicas):
        base = (i + 1) * 10_000_000
        policy.update_published(f"r{i}", frozenset(range(base, base + num_keys)))
        policy.record(RoutingKey(tuple(range(base + num_keys, base + num_keys + num_keys // 10))), f"r{i}")
    return policy


def decision_ms(num_replicas: int, num_keys: int, num_decisions: int) -> float:
    from rayserve_paged.deployments.routing import RoutingKey

    policy = fleet(num_replicas, num_keys)
    loads = {f"r{i}": 0.0 for i in range(num_replicas)}
    times = []
    for _ in range(num_decisions):
        start = time.perf_counter()
        policy.choose(RoutingKey((1, 2, 3)), loads)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayserve-paged bench routing-cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--keys", type=int, nargs="+", default=[10_000, 100_000, 500_000])
    parser.add_argument("--decisions", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = []
    for n in args.replicas:
        for k in args.keys:
            ms = decision_ms(n, k, args.decisions)
            rows.append({"replicas": n, "keys": k, "decision_ms": round(ms, 4)})
            print(f"{n} replicas x {k:>7} keys: {ms:9.3f} ms per decision", flush=True)
    write_json(args.out, "routing_cost.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
