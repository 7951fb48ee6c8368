"""gpu_check's kernel check: the Triton tests (compiled on the GPU, interpreted on CPU), the
memcheck run, the copy bandwidth and paged decode / prefill attention timed against dense
SDPA. benchmarks/gpu_check.py runs it; its docstring has the plan."""

from __future__ import annotations

import gc
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# wall-clock guards of the test runs (seconds): killed (the whole process group) after these
TESTS_TIMEOUT_S = {"quick": 150, "full": 200}
MEMCHECK_TIMEOUT_S = {"quick": 60, "full": 60}
# no new copy / decode / prefill point starts after this many seconds of those sections
BENCH_BUDGET_S = {"quick": 80.0, "full": 130.0}
NOMINAL_L2_BYTES = 50 * 2**20  # H100 / H200; where the device does not say (and on CPU)
FLUSH_L2_TIMES = 4  # the buffer read between timed replays: this many times the L2
CUDA = "cuda:0"  # every device this check hands the project's code names its index
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (512, 2048, 8192)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
PREFILL_CASES = ((1, 0, 2048), (8, 0, 512), (4, 1024, 512), (16, 0, 128))  # (num_seqs, context, new tokens)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() > self.end


# ---------------------------------------------------------------------------- tests


TRITON_TESTS = [
    sys.executable, "-m", "pytest", "tests/ops/test_triton.py", "tests/ops/test_triton_lora.py", "-q", "-p",
    "no:cacheprovider",
]  # fmt: skip


def run_tests(has_cuda: bool, quick: bool) -> dict:
    device = "cuda" if has_cuda else "cpu"
    command = TRITON_TESTS + (["-m", "quick"] if quick else [])
    result = _run_pytest(command, device, TESTS_TIMEOUT_S["quick" if quick else "full"])
    del result["output"]
    return result | {"device": device, "interpreter": not has_cuda}


def find_compute_sanitizer() -> str | None:
    """compute-sanitizer on PATH, in $CUDA_HOME/bin or in a /usr/local/cuda*/bin; None if absent."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    folders = [Path(os.environ["CUDA_HOME"]) / "bin"] if os.environ.get("CUDA_HOME") else []
    folders += sorted(Path("/usr/local").glob("cuda*/bin"))
    return next((str(folder / "compute-sanitizer") for folder in folders if (folder / "compute-sanitizer").is_file()), None)


def memcheck_skip_reason(has_cuda: bool, sanitizer: str | None) -> str | None:
    """Why the memcheck step cannot run here; None when it can."""
    if not has_cuda:
        return "no CUDA device: compute-sanitizer has nothing to check"
    if sanitizer is None:
        return "compute-sanitizer not found (looked on PATH, in $CUDA_HOME/bin and /usr/local/cuda*/bin)"
    return None


def run_memcheck(sanitizer: str, quick: bool) -> dict:
    """The `quick` Triton tests (one per kernel path, small shapes; the kernels compiled by
    the tests step come from Triton's cache) under compute-sanitizer's memcheck: any
    out-of-bounds or misaligned access fails the step. The sanitizer and the pytest it
    starts run in a session of their own, killed as a group at the timeout."""
    command = [sanitizer, "--tool", "memcheck", "--error-exitcode", "1", "--print-limit", "20",
               "--target-processes", "all"] + TRITON_TESTS + ["-m", "quick"]
    result = _run_pytest(command, "cuda", MEMCHECK_TIMEOUT_S["quick" if quick else "full"])
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", result.pop("output"))
    return result | {"sanitizer_errors": int(errors[-1]) if errors else None, "clean": result["returncode"] == 0}


def run_in_session(command: list[str], timeout: float, **options) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of `command` started in a session of its own; at the
    timeout its whole process group is killed (a sanitizer's child pytest included) and
    TimeoutError raised."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **options)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        print(stdout[-4000:], stderr[-2000:], sep="\n")
        raise TimeoutError(f"{' '.join(command[:3])} ... killed with its process group after {timeout} s") from None
    except BaseException:  # this run is ending (SIGTERM, Ctrl-C): the group must not outlive it
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, stdout, stderr


def _run_pytest(command: list[str], device: str, timeout: float) -> dict:
    env = os.environ | {"RAYSERVE_PAGED_TRITON_TEST_DEVICE": device}
    started = time.monotonic()
    returncode, stdout, stderr = run_in_session(command, timeout, cwd=REPO_ROOT, env=env)
    lines = [line for line in stdout.strip().splitlines()  # pytest's last line: "N passed ... in S s"
             if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s", line)]
    summary = lines[-1] if lines else (stdout.strip().splitlines() or [""])[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    if returncode != 0:
        print(stdout[-4000:], stderr[-2000:], sep="\n")
    return {
        "command": " ".join(command[1:] if command[0] == sys.executable else command), "returncode": returncode,
        "summary": summary, "counts": counts, "seconds": round(time.monotonic() - started, 1),
        "output": stdout + stderr,
    }


# ---------------------------------------------------------------------------- timing


def l2_bytes(torch, device=CUDA) -> int:
    """The device's L2 size (NOMINAL_L2_BYTES where it does not say, and off CUDA)."""
    if torch.device(device).type != "cuda":
        return NOMINAL_L2_BYTES
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or NOMINAL_L2_BYTES)


def l2_flags(working_set_bytes: int, l2: int) -> dict:
    """What a point records about the L2: its working set, and whether that fits in the L2
    (its figure is then HBM-cold only because the timer flushed the L2 before each replay;
    in serving such a point can run from the L2)."""
    return {"working_set_bytes": working_set_bytes, "fits_l2": working_set_bytes <= l2, "l2_bytes": l2}


_FLUSH: dict = {}


def flush_l2(torch) -> None:
    """Read a buffer of FLUSH_L2_TIMES x the L2 (clean lines: no write-back lands in the
    timed kernel), so that the next kernel finds none of its inputs in the L2."""
    buffer = _FLUSH.get("buffer")
    if buffer is None:
        buffer = _FLUSH["buffer"] = torch.ones(FLUSH_L2_TIMES * l2_bytes(torch) // 4, dtype=torch.float32, device=CUDA)
    buffer.sum()


def cuda_median_ms(torch, fn, *, repeats: int, warmup: int = 3) -> dict:
    """Median ms of `fn` replayed from a CUDA graph (eager if capture fails), and eager; each
    repeat L2-cold: the L2 is flushed before it (outside the timed events)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    eager_ms = _median_ms(torch, fn, repeats)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        timed = _median_ms(torch, graph.replay, repeats)
        return {"ms": timed, "eager_ms": eager_ms, "timing": "cuda_graph, L2 flushed before each replay"}
    except Exception as error:  # noqa: BLE001 - fall back to eager timing, and say so
        torch.cuda.synchronize()
        return {"ms": eager_ms, "eager_ms": eager_ms, "timing": f"eager ({type(error).__name__}), L2 flushed"}


def _median_ms(torch, fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        flush_l2(torch)  # before the start event: not timed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(torch, num_bytes: int = 2 * 2**30) -> dict:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    timed = cuda_median_ms(torch, lambda: dst.copy_(src), repeats=20)
    gbps = 2 * num_bytes / (timed["ms"] * 1e-3) / 1e9  # read + write
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": num_bytes, "ms": timed["ms"], "gbps": gbps, "note": "GB/s counts bytes read + written",
            **l2_flags(2 * num_bytes, l2_bytes(torch))}  # fmt: skip


# ---------------------------------------------------------------------------- decode


def decode_bytes(batch: int, context: int, element_size: int, *, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                 head_dim=HEAD_DIM, block_size=BLOCK_SIZE) -> int:
    """Bytes a decode step must move: each sequence's K and V, its query and output, its
    block table row and length."""
    kv = 2 * context * num_kv_heads * head_dim * element_size
    query_and_out = 2 * num_heads * head_dim * element_size
    table = math.ceil(context / block_size) * 4 + 4
    return batch * (kv + query_and_out + table)


def decode_benchmark(torch, quick: bool, copy_gbps: float | None, deadline: Deadline) -> list[dict]:
    dtypes = (torch.float16, torch.bfloat16)
    batches = (1, 64) if quick else DECODE_BATCHES
    contexts = (512, 8192) if quick else DECODE_CONTEXTS
    rows = []
    for dtype in dtypes:
        for batch in batches:
            for context in contexts:
                if deadline.expired():
                    rows.append({"dtype": str(dtype), "batch": batch, "context": context, "skipped": "time budget"})
                    continue
                row = decode_point(torch, dtype, batch, context, repeats=10 if quick else 20)
                if copy_gbps:
                    row["fraction_of_copy_bandwidth"] = row["gbps"] / copy_gbps
                rows.append(row)
                print(f"  decode {row['dtype']} batch {batch} context {context}: {row['ms']:.4f} ms "
                      f"{row['gbps']:.0f} GB/s ({row['variant']}), dense {row.get('dense_ms', float('nan')):.4f} ms",
                      flush=True)
    return rows


def decode_point(torch, dtype, batch: int, context: int, *, repeats: int, device=CUDA, timer=None) -> dict:
    """One decode measurement (L2-cold; the point flagged where its working set fits in the
    L2). `device` and `timer` exist so the CPU tests can run this code under the interpreter
    with a stand-in timer."""
    import torch.nn.functional as F

    from rayserve_paged.ops.triton_backend import NOMINAL_NUM_SMS, choose_decode_variant, paged_decode_attention

    timer = timer or cuda_median_ms
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    generator = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
    key_cache, value_cache, block_tables = scattered_cache(torch, batch, blocks_per_seq, generator, device, dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn((batch, NUM_HEADS, HEAD_DIM), generator=generator, device=device, dtype=dtype)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    is_cuda = torch.device(device).type == "cuda"
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if is_cuda else NOMINAL_NUM_SMS
    rule = choose_decode_variant(batch, NUM_KV_HEADS, context, num_sms)

    def paged(variant):
        return lambda: paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, context, scale, out=out, variant=variant
        )

    timings = {variant: timer(torch, paged(variant), repeats=repeats) for variant in ("single", "partitioned")}
    num_bytes = decode_bytes(batch, context, query.element_size())
    row = {
        "dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context, "variant": rule,
        "ms": timings[rule]["ms"], "eager_ms": timings[rule]["eager_ms"], "timing": timings[rule]["timing"],
        "single_ms": timings["single"]["ms"], "partitioned_ms": timings["partitioned"]["ms"],
        "bytes": num_bytes, "gbps": num_bytes / (timings[rule]["ms"] * 1e-3) / 1e9,
        **l2_flags(num_bytes, l2_bytes(torch, device)),
    }
    row["rule_picked_faster"] = timings[rule]["ms"] <= min(t["ms"] for t in timings.values()) * 1.02
    # the same K/V laid out contiguously: [batch, num_kv_heads, context, head_dim]
    index = block_tables.long()
    dense_k = key_cache[index].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    dense_v = value_cache[index].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    grouped_query = query.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)  # heads folded as rows

    def dense():
        return F.scaled_dot_product_attention(grouped_query, dense_k, dense_v, scale=scale)

    dense_timing = timer(torch, dense, repeats=repeats)
    row |= {"dense_ms": dense_timing["ms"], "paged_over_dense": row["ms"] / dense_timing["ms"]}
    paged(rule)()
    row["max_abs_diff_vs_dense"] = float((out.view_as(grouped_query).float() - dense().float()).abs().max())
    del key_cache, value_cache, dense_k, dense_v, block_tables, query, out
    free_memory(torch)
    return row


# ---------------------------------------------------------------------------- prefill


def scattered_cache(torch, num_seqs: int, blocks_per_seq: int, generator, device, dtype):
    """Random K and V caches of num_seqs x blocks_per_seq blocks, and block tables that
    scatter each sequence over the pool, as after a while of serving (drawn from
    `generator` in this order)."""
    num_blocks = num_seqs * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32)
    return key_cache, value_cache, block_tables.view(num_seqs, blocks_per_seq)  # tables [num_seqs, blocks_per_seq]


def prefill_benchmark(torch, quick: bool, deadline: Deadline) -> list[dict]:
    dtypes = (torch.float16,) if quick else (torch.float16, torch.bfloat16)
    cases = PREFILL_CASES[:2] if quick else PREFILL_CASES
    rows = []
    for dtype in dtypes:
        for num_seqs, context, new_tokens in cases:
            if deadline.expired():
                rows.append({"dtype": str(dtype), "num_seqs": num_seqs, "skipped": "time budget"})
                continue
            row = prefill_point(torch, dtype, num_seqs, context, new_tokens, repeats=10 if quick else 20)
            rows.append(row)
            print(f"  prefill {row['dtype']} {num_seqs} x ({context} + {new_tokens}): {row['ms']:.3f} ms "
                  f"{row['tflops']:.1f} TFLOP/s", flush=True)
    return rows


def prefill_flops(num_seqs: int, context: int, new_tokens: int, num_heads=NUM_HEADS, head_dim=HEAD_DIM) -> int:
    """2 matmuls x 2 flops per multiply-add over the visible (query, key) pairs."""
    visible = new_tokens * context + new_tokens * (new_tokens + 1) // 2
    return 4 * num_seqs * num_heads * head_dim * visible


def prefill_point(
    torch, dtype, num_seqs: int, context: int, new_tokens: int, *, repeats: int, device=CUDA, timer=None
) -> dict:
    import torch.nn.functional as F

    from rayserve_paged.ops.triton_backend import paged_prefill_attention

    timer = timer or cuda_median_ms
    seq_len = context + new_tokens
    blocks_per_seq = math.ceil(seq_len / BLOCK_SIZE)
    generator = torch.Generator(device=device).manual_seed(num_seqs * 7919 + seq_len)
    key_cache, value_cache, block_tables = scattered_cache(torch, num_seqs, blocks_per_seq, generator, device, dtype)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * new_tokens
    context_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    query = torch.randn((num_seqs * new_tokens, NUM_HEADS, HEAD_DIM), generator=generator, device=device, dtype=dtype)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5

    def paged():
        return paged_prefill_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, context_lens, new_tokens, scale, out=out
        )

    timing = timer(torch, paged, repeats=repeats)
    flops = prefill_flops(num_seqs, context, new_tokens)
    row = {
        "dtype": str(dtype).removeprefix("torch."), "num_seqs": num_seqs, "context": context, "new_tokens": new_tokens,
        "ms": timing["ms"], "eager_ms": timing["eager_ms"], "timing": timing["timing"],
        "tflops": flops / (timing["ms"] * 1e-3) / 1e12,
        # K and V of every sequence, the query and the output
        **l2_flags(2 * num_seqs * seq_len * NUM_KV_HEADS * HEAD_DIM * query.element_size() + 2 * query.nbytes,
                   l2_bytes(torch, device)),
    }
    # dense: SDPA over contiguous [num_seqs, heads, len, head_dim], K/V repeated to every query head
    group = NUM_HEADS // NUM_KV_HEADS
    index = block_tables.long()
    dense_k = key_cache[index].reshape(num_seqs, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2)
    dense_v = value_cache[index].reshape(num_seqs, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2)
    dense_k = dense_k.repeat_interleave(group, dim=1).contiguous()  # [num_seqs, heads, seq_len, head_dim]
    dense_v = dense_v.repeat_interleave(group, dim=1).contiguous()
    dense_q = query.view(num_seqs, new_tokens, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    try:
        if context == 0:
            def dense():
                return F.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=True, scale=scale)
        else:
            from torch.nn.attention.bias import causal_lower_right

            bias = causal_lower_right(new_tokens, seq_len)

            def dense():
                return F.scaled_dot_product_attention(dense_q, dense_k, dense_v, attn_mask=bias, scale=scale)

        dense_timing = timer(torch, dense, repeats=repeats)
        row |= {"dense_ms": dense_timing["ms"], "paged_over_dense": timing["ms"] / dense_timing["ms"]}
        paged()
        expected = dense().transpose(1, 2).reshape_as(out)
        row["max_abs_diff_vs_dense"] = float((out.float() - expected.float()).abs().max())
    except Exception as error:  # noqa: BLE001 - the paged figures stand without the comparison
        row["dense_error"] = f"{type(error).__name__}: {error}"
    del key_cache, value_cache, dense_k, dense_v
    free_memory(torch)
    return row


def quant_check(torch, has_cuda: bool) -> dict:
    """FP8 and 4-bit group-quantized layers against the float32 product of their own weights;
    on CUDA also their time against bfloat16 F.linear (see gpu_check's docstring)."""
    from rayserve_paged.models.layers import ColumnParallelLinear
    from rayserve_paged.models.quant import Fp8LinearMethod, GroupQuantFormat, GroupQuantLinearMethod, quantize_fp8

    device = torch.device(CUDA if has_cuda else "cpu")
    size = 4096 if has_cuda else 256
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(size, size, generator=g) * 0.02
    layers = {}
    fp8 = ColumnParallelLinear(size, size, bias=False)
    fp8.set_method(Fp8LinearMethod(None if has_cuda else True))  # the CPU: torch's _scaled_mm, forced
    w8, scale = quantize_fp8(weight)
    fp8.weight.data.copy_(w8), fp8.weight_scale.data.copy_(scale)
    layers["fp8"] = fp8
    if has_cuda:
        int4 = ColumnParallelLinear(size, size, bias=False)
        int4.set_method(GroupQuantLinearMethod(GroupQuantFormat("int4", 4, 128)))
        int4.weight_codes.data.copy_(torch.randint(0, 16, (size, size), generator=g, dtype=torch.uint8))
        int4.weight_scales.data.copy_(torch.rand(size, size // 128, generator=g) * 0.01)
        int4.weight_offsets.data.copy_(-8 * int4.weight_scales.data)
        layers["int4"] = int4
    rows = []
    for name, layer in layers.items():
        layer.to(device)
        layer.model_dtype = torch.bfloat16 if has_cuda else torch.float32
        layer.process_weights_after_loading()
        reference = layer.method.dequantize(layer)  # [out, in] float32: the layer's own weights
        dense = reference.to(torch.bfloat16)
        kernel = ("torch._scaled_mm" if layer.fp8_scaled_mm else "dequantized at load") if name == "fp8" else "triton"
        for num_rows in (1, 16, 256):
            x = torch.randn(num_rows, size, generator=g).to(device, layer.model_dtype)
            y = layer.matmul(x).float()
            want = x.float() @ reference.t()
            bound = 2**-3 * (x.float().abs() @ reference.abs().t()) + 1e-3  # activations rounded to 8 bits or fewer
            row = {"rows": num_rows, "layer": name, "kernel": kernel,
                   "error_over_bound": ((y - want).abs() / bound).max().item()}  # fmt: skip
            weight_bytes = sum(p.nbytes for p in layer.parameters()) + sum(b.nbytes for b in layer.buffers())
            row |= l2_flags(weight_bytes + x.nbytes + y.nbytes // 2, l2_bytes(torch, device))  # fmt: skip
            if has_cuda:  # L2-cold: the 8 MiB of int4 codes (32 MiB of bf16) would otherwise stay in the L2
                row["ms"] = cuda_median_ms(torch, lambda: layer.matmul(x), repeats=20)["ms"]
                xb = x.to(torch.bfloat16)
                row["bf16_ms"] = cuda_median_ms(torch, lambda: torch.nn.functional.linear(xb, dense), repeats=20)["ms"]
                row["bf16_over_quant"] = row["bf16_ms"] / row["ms"]
                row["bf16_fits_l2"] = dense.nbytes <= l2_bytes(torch, device)
            rows.append(row)
    bad = [row for row in rows if row["error_over_bound"] > 1]
    return {"device": str(device), "rows": rows, "failures": [f"{r['layer']} x{r['rows']}: error above the bound"
                                                               for r in bad]}  # fmt: skip


def free_memory(torch) -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def report_lines(report: dict) -> list[str]:
    """The summary table's lines of the kernel check's sections."""
    lines = []
    tests = report.get("tests")
    if tests:
        where = "CPU, Triton interpreter" if tests["interpreter"] else "GPU, compiled"
        lines.append(f"tests             {tests['summary']} ({where}{', -m quick' if report['quick'] else ''})")
    memcheck = report.get("memcheck")
    if memcheck:
        verdict = "clean" if memcheck["clean"] else f"FAILED ({memcheck['sanitizer_errors']} errors reported)"
        lines.append(f"memcheck          {verdict}: {memcheck['summary']} (compute-sanitizer, -m quick)")
    copy = report.get("copy_bandwidth")
    if copy:
        gib = copy["bytes"] / 2**30
        lines.append(f"copy bandwidth    {copy['gbps']:.0f} GB/s (read + write, {gib:.0f} GiB tensor)")
    decode = [row for row in report.get("decode", []) if "ms" in row]
    if decode:
        lines.append(
            "decode            dtype     batch context rule picks        ms    GB/s  %copy  paged/dense"
            "  single_ms  partitioned_ms  (L2: working set fits in L2, timed after a flush)"
        )
        for row in decode:
            fraction = row.get("fraction_of_copy_bandwidth")
            lines.append(
                f"                  {row['dtype']:<9} {row['batch']:>5} {row['context']:>7} {row['variant']:<11}"
                f" {row['ms']:>8.4f} {row['gbps']:>7.0f} {100 * fraction if fraction else float('nan'):>5.1f}%"
                f" {row.get('paged_over_dense', float('nan')):>12.2f} {row['single_ms']:>10.4f}"
                f" {row['partitioned_ms']:>15.4f}{'  L2' if row.get('fits_l2') else ''}"
            )
    prefill = [row for row in report.get("prefill", []) if "ms" in row]
    if prefill:
        lines.append("prefill           dtype     seqs context   new       ms  TFLOP/s  paged/dense")
        for row in prefill:
            lines.append(
                f"                  {row['dtype']:<9} {row['num_seqs']:>4} {row['context']:>7} {row['new_tokens']:>5}"
                f" {row['ms']:>8.3f} {row['tflops']:>8.1f} {row.get('paged_over_dense', float('nan')):>8.2f}"
            )
    quant = report.get("quant")
    if quant:
        lines.append(f"quant             {quant['device']}: rows, layer, kernel, max error / bound, ms (bf16 F.linear ms)")
        for row in quant["rows"]:
            timing = (f" {row['ms']:.4f} ({row['bf16_ms']:.4f}; bf16 / quant {row['bf16_over_quant']:.2f})"
                      if "ms" in row else "")  # fmt: skip
            lines.append(f"                  {row['rows']:>4} {row['layer']:<5} {row['kernel']:<22} "
                         f"{row['error_over_bound']:.3f}{timing}")  # fmt: skip
    return lines
