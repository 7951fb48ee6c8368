"""The plots of docs/BENCHMARKS.md, drawn from the benchmarks' own JSON records.

    rayserve-paged bench report --from docs/benchmarks/data --out docs/images

Each plot is made from the record its benchmark writes with `--out DIR` (the file names the
benchmarks give them), so rerunning a benchmark into the folder and then this command
refreshes the figure; nothing is drawn by hand. Every plot names the commit and machine of
its record. A record that is not in any folder is reported and its plot skipped.

- kv_memory.png      from memory.json         share of KV slots holding token state and mean
                                              batched requests, against the paper's (Fig. 2, 13)
- throughput.png     from throughput.json     the engine against HF `generate` over HF batch sizes
- serving.png        from serving.json        TTFT / TPOT / end-to-end percentiles over request rate
- smollm2.png        from quantized.json      SmolLM2 tokens/s on one stream and 32 chats: quantized,
                                              float32 and llama-server (when the record has it)
- routing.png        from fleet_routing*.json fleet prefix-cache hit rate over replicas, by routing mode
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

from benchmarks.options import benchmark_parser

SYSTEMS = ("orca_max", "orca_pow2", "orca_oracle", "paged")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def provenance(record: dict) -> str:
    """'commit abc1234, 2 CPUs, load 1.2' from a record's machine entry."""
    machine = record.get("machine", {})
    load = machine.get("load_average")
    parts = [f"commit {machine.get('commit') or 'unknown'}", f"{machine.get('cpu_count', '?')} CPUs"]
    if load:
        parts.append(f"load {load[0]:g}")
    return ", ".join(parts)


def _save(fig, record: dict, title: str, path: str) -> None:
    fig.suptitle(f"{title}\n({provenance(record)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def plot_kv_memory(record: dict, path: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [n for n in SYSTEMS if n in record["sharegpt"]]
    xs = range(len(names))
    ours = [record["sharegpt"][n]["pool_token_state"] * 100 for n in names]
    paper = [record["paper"]["token_state_share"][n] * 100 for n in names]
    axes[0].bar([x - 0.2 for x in xs], ours, 0.4, label="rayserve-paged")
    axes[0].bar([x + 0.2 for x in xs], paper, 0.4, label="paper (Fig. 2)")
    axes[0].set_ylabel("% of KV memory holding token state")
    axes[0].set_title("ShareGPT lengths, saturated")
    for ax, dataset in zip(axes[1:], ("sharegpt", "alpaca")):
        ours = [record[dataset][n]["mean_batched_poisson"] for n in names]
        paper = [record["paper"]["mean_batched_poisson"][dataset][n] for n in names]
        ax.bar([x - 0.2 for x in xs], ours, 0.4, label="rayserve-paged")
        ax.bar([x + 0.2 for x in xs], paper, 0.4, label="paper (Fig. 13)")
        ax.set_ylabel("mean batched requests")
        rate = record["config"]["datasets"][dataset]["poisson_rate"]
        ax.set_title(f"{dataset}, Poisson {rate:g} req/s")
    for ax in axes:
        ax.set_xticks(list(xs), names, rotation=15)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    _save(fig, record, "KV memory: paged blocks against contiguous reservation (OPT-13B's KV budget)", path)


def plot_throughput(record: dict, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sweep = {int(b): v for b, v in record["hf_sweep_output_tokens_per_s"].items()}
    if record.get("hf_batch_size") is not None:
        sweep.setdefault(int(record["hf_batch_size"]), record["hf_output_tokens_per_s"])
    sizes = sorted(sweep)
    ax.plot(sizes, [sweep[b] for b in sizes], "-o", label="HF generate, static batches")
    ax.axhline(record["engine_output_tokens_per_s"], color="tab:orange", label="rayserve-paged, all requests at once")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("HF batch size")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, record, "Engine throughput against HF transformers (small OPT, uniform lengths, greedy)", path)


def plot_serving(record: dict, path: str) -> None:
    from benchmarks.serving import plot

    plot(record["runs"], path, provenance(record))


SMOLLM2_SYSTEMS = (("serve_auto", "rayserve-paged, 4-bit"), ("serve_none", "rayserve-paged, float32"),
                   ("llama_server", "llama-server, same GGUF"))  # fmt: skip


def smollm2_bars(record: dict) -> list[tuple[str, dict[str, float]]]:
    """(label, {"single": tok/s, "concurrent": tok/s}) of each system the quantized record
    measured over HTTP; the record's figures are under "results" (`write_record`)."""
    results = record["results"]
    return [(label, {phase: results[key][phase]["tokens_per_s"] for phase in ("single", "concurrent")})
            for key, label in SMOLLM2_SYSTEMS if "single" in results.get(key, {})]  # fmt: skip


def plot_smollm2(record: dict, path: str) -> None:
    plt = _pyplot()
    bars, results = smollm2_bars(record), record["results"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase, title in ((axes[0], "single", "one stream"), (axes[1], "concurrent", "concurrent chats")):
        values = [figures[phase] for _, figures in bars]
        ax.bar([label for label, _ in bars], values)
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{title} ({results.get('num_requests', '?')} chats)" if phase == "concurrent" else title)
        ax.tick_params(axis="x", labelrotation=10)
        ax.grid(axis="y", alpha=0.3)
    _save(fig, record, f"SmolLM2-135M-Instruct over HTTP, {results.get('threads', '?')} thread(s)", path)


def plot_routing(records: list[dict], path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        replicas = record["config"]["workload"]["replicas"]
        for run in record["runs"]:
            points.setdefault(run["routing"], []).append((replicas, run["fleet_hit_rate"]))
    for routing, xy in sorted(points.items()):
        ax.plot(*zip(*sorted(xy)), "-o", label=f"routing: {routing}")
    replicas = sorted({x for xy in points.values() for x, _ in xy})
    ax.set_xticks(replicas, [str(r) for r in replicas])
    ax.set_xlabel("replicas")
    ax.set_ylabel("fleet prefix-cache hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, records[-1], "Fleet routing: prefix-cache hit rate over replicas", path)


# (output file, record file name or prefix, plot, whether every record with the prefix is taken)
PLOTS: list[tuple[str, str, Callable, bool]] = [
    ("kv_memory.png", "memory.json", plot_kv_memory, False),
    ("throughput.png", "throughput.json", plot_throughput, False),
    ("serving.png", "serving.json", plot_serving, False),
    ("smollm2.png", "quantized.json", plot_smollm2, False),
    ("routing.png", "fleet_routing", plot_routing, True),
]


def find_records(folders: list[str], name: str, every: bool) -> list[dict]:
    """The records called `name` (or, with `every`, starting with it) in the folders, in order."""
    found = []
    for folder in folders:
        for file_name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if file_name == name or (every and file_name.startswith(name) and file_name.endswith(".json")):
                with open(os.path.join(folder, file_name), encoding="utf-8") as f:
                    found.append(json.load(f))
    return found


def report(folders: list[str], out_dir: str) -> dict[str, str]:
    """Every plot whose record is found: {png file: its path, or why it was skipped}."""
    os.makedirs(out_dir, exist_ok=True)
    made = {}
    for png, name, draw, every in PLOTS:
        records = find_records(folders, name, every)
        if not records:
            made[png] = f"skipped: no {name}{'*' if every else ''} in {', '.join(folders)}"
            continue
        path = os.path.join(out_dir, png)
        draw(records if every else records[-1], path)
        made[png] = path
    return made


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench report", __doc__.splitlines()[0], out_required=True,
                              out_help="directory for the PNG files (docs/images)", seed=None)  # fmt: skip
    parser.add_argument("--from", dest="folders", action="append", default=None,
                        help="a folder of benchmark records (repeatable; default docs/benchmarks/data)")
    args = parser.parse_args(argv)
    for png, where in report(args.folders or ["docs/benchmarks/data"], args.out).items():
        print(f"{png}: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
