"""Ahead-of-time compilation of every Triton kernel variant the backend launches, for
sm_80 (A100), sm_89 (L40S) and sm_90 (H100 / H200), on a machine without a GPU.

    python -m rayserve_paged.ops.triton_aot [--jobs N] [--markdown]      # the CI set, a table

Triton's compiler needs no GPU: `triton.compile(ASTSource(kernel, signature, constants),
target=GPUTarget("cuda", capability, 32))` lowers a kernel to TTGIR, PTX and a cubin; its
metadata gives the shared memory per block, and ptxas (bundled with triton) run with -v
on the PTX reports registers and spill bytes.

What is compiled (`ci_configs`): the constants come from the same functions the wrappers
launch with (triton_backend.*_constants), so this compiles the variants serving runs. Shared
memory, registers and vector widths depend on the dtype, the padded head size and the tile
the wrappers pick for them; the group size, block size, kv-head count and partition size
only change index arithmetic and masks. So per target every kernel is compiled for every
(dtype, head size) pair, and the group sizes 1..8, block sizes 8/16/32, kv-head counts and
partition sizes rotate over those pairs, so each value is compiled at least once per kernel
and target. The runtime integer arguments are specialised the way the launcher does it
(divisible by 16 or not; `do_not_specialize` arguments not at all), with the strides of a
model's packed QKV projection. The group-quantized GEMM (ops/quant_gemm.py) is compiled for
every (dtype, bits) pair with its quantization group sizes and its two row tiles rotating;
the LoRA kernels (ops/triton_lora.py) for every dtype at rank widths 16 / 48 / 64 / 192.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

KB = 1024


@dataclass(frozen=True)
class Target:
    name: str
    capability: int
    smem_limit: int  # bytes of shared memory one block may use (opt-in maximum)
    gpu: str


TARGETS = (
    Target("sm_80", 80, 163 * KB, "A100"),
    Target("sm_89", 89, 99 * KB, "L40S"),
    Target("sm_90", 90, 227 * KB, "H100/H200"),
)
KERNELS = (
    "decode", "decode_partition", "decode_reduce", "prefill", "reshape_and_cache", "group_quant_gemm",
    "lora_shrink", "lora_expand",
)  # fmt: skip
LORA_KERNELS = ("lora_shrink", "lora_expand")
LORA_WIDTHS = (16, 48, 64, 192)  # rank 16 on one layer / on q|k|v; rank 64 on one layer / on q|k|v
QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 128)
QUANT_ROWS = (1, 64)  # a decode step's rows (BLOCK_M 16) and a prefill's (BLOCK_M 64)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 72, 80, 96, 128, 256)  # the common model head sizes; 72 is not a multiple of 16
GROUP_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)
BLOCK_SIZES = (8, 16, 32)
KV_HEADS = (8, 2, 32, 40, 1)  # per rank; 40 (MHA models) pads the cache-write tile to 64 rows


@dataclass(frozen=True)
class KernelConfig:
    kernel: str
    dtype: str  # "float16" | "bfloat16" | "float32"
    head_dim: int
    group_size: int = 1
    block_size: int = 16
    num_kv_heads: int = 8
    partition_size: int = 0  # decode_partition / decode_reduce only
    bits: int = 0  # group_quant_gemm only (group_size is then the quantization group)
    num_rows: int = 0  # group_quant_gemm only
    lora_width: int = 0  # lora kernels only: the pool's rank width
    sliding: bool = False  # attention kernels and decode_reduce: a sliding window
    soft_cap: bool = False  # attention kernels: attention logit soft-capping

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


PAD_CLASSES = (64, 72, 128, 256)  # one head size per padded width (72: the unaligned one), for the cheap kernels
SAME_AS_SM80 = "sm_89"  # lowers through the same (Ampere MMA) pipeline as sm_80: sampled, and compared


def ci_configs(target: Target | None = None) -> list[KernelConfig]:
    """The configurations compiled for `target` (see the module doc):

    * sm_80 and sm_90: decode, decode_partition and prefill for float16 and bfloat16 at every
      head size in HEAD_DIMS, float32 at 64 / 128 / 256 (72, 80 and 96 run padded to 128 with
      128's tile); decode_reduce and reshape_and_cache for every dtype at 64 / 72 / 128 / 256.
    * sm_89: every kernel at head size 128 in float16 and bfloat16. sm_89 lowers through the
      same pipeline as sm_80 (it adds fp8 only), so the test asserts the sampled sm_89
      results equal sm_80's and checks every sm_80 result against the sm_89 (L40S) limits.
    """
    from .triton_backend import PARTITION_SIZES

    if target is not None and target.name == SAME_AS_SM80:
        return [c for c in ci_configs() if c.head_dim == 128 and c.dtype != "float32"]
    configs = []
    for kernel in KERNELS:
        index = 0
        if kernel == "group_quant_gemm":  # every dtype x bits; group sizes and row tiles rotate
            for dtype in DTYPES:
                for bits in QUANT_BITS:
                    configs.append(KernelConfig(
                        kernel, str(dtype).removeprefix("torch."), 0, bits=bits,
                        group_size=QUANT_GROUP_SIZES[index % len(QUANT_GROUP_SIZES)],
                        num_rows=QUANT_ROWS[index // len(QUANT_GROUP_SIZES) % len(QUANT_ROWS)],
                    ))  # fmt: skip
                    index += 1
            continue
        if kernel in LORA_KERNELS:  # every dtype; the rank widths (shrink's tile) rotate
            for i, dtype in enumerate(DTYPES):
                for width in (LORA_WIDTHS[i % 2], LORA_WIDTHS[2 + i % 2]):
                    configs.append(KernelConfig(kernel, str(dtype).removeprefix("torch."), 0, lora_width=width))
            continue
        for dtype in DTYPES:
            name = str(dtype).removeprefix("torch.")
            if kernel in ("decode", "decode_partition", "prefill"):
                head_dims = HEAD_DIMS if dtype != torch.float32 else (64, 128, 256)
            else:
                head_dims = PAD_CLASSES
            for head_dim in head_dims:
                extra = {}
                if kernel in ("decode_partition", "decode_reduce"):
                    extra["partition_size"] = PARTITION_SIZES[index % len(PARTITION_SIZES)]
                configs.append(
                    KernelConfig(
                        kernel, name, head_dim,
                        group_size=GROUP_SIZES[index % len(GROUP_SIZES)],
                        block_size=BLOCK_SIZES[index % len(BLOCK_SIZES)],
                        num_kv_heads=KV_HEADS[index % len(KV_HEADS)], **extra,
                    )
                )
                index += 1
    return configs + masking_configs()


# (sliding, soft_cap) variants beside the plain ones, at the shapes of the models that use
# them: a window alone at bfloat16 / 128 (Qwen2.5-7B: group 7; Qwen3-8B, Mistral: group 4),
# Gemma 2's both (sliding layers) and soft-cap alone (global layers) at 256 / group 2.
MASKINGS = ((True, False), (True, True), (False, True))
MASKING_SHAPES = (
    ("bfloat16", 128, 7, True, False),
    ("bfloat16", 128, 4, True, False),
    ("bfloat16", 256, 2, True, True),
    ("bfloat16", 256, 2, False, True),
    ("float16", 256, 2, True, True),
)


def masking_configs() -> list[KernelConfig]:
    configs = []
    for kernel in ("decode", "decode_partition", "prefill"):
        extra = {"partition_size": 512} if kernel == "decode_partition" else {}
        for dtype, head_dim, group_size, sliding, soft_cap in MASKING_SHAPES:
            configs.append(KernelConfig(
                kernel, dtype, head_dim, group_size=group_size, sliding=sliding, soft_cap=soft_cap, **extra
            ))  # fmt: skip
    configs.append(KernelConfig("decode_reduce", "bfloat16", 128, partition_size=512, sliding=True))
    return configs


# ---------------------------------------------------------------------------- one compile


_POINTER_TYPES = {
    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "context_lens_ptr": "*i32",
    "slot_mapping_ptr": "*i64", "partial_out_ptr": "*fp32", "max_logits_ptr": "*fp32", "exp_sums_ptr": "*fp32",
    "packed_ptr": "*u8", "scales_ptr": "*fp32", "offsets_ptr": "*fp32", "slots_ptr": "*i32", "xa_ptr": "*fp32",
}
_TRITON_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def launch_spec(config: KernelConfig):
    """(jit function, signature, constants, attrs, num_warps) of one configuration."""
    from . import triton_backend as backend
    from . import triton_kernels as kernels

    dtype, head_dim, kv_heads = config.torch_dtype, config.head_dim, config.num_kv_heads
    num_heads = kv_heads * config.group_size
    if config.kernel in ("decode", "decode_partition"):
        constants = backend.attention_constants(
            "decode", dtype, head_dim, kv_heads, config.group_size, config.block_size, interpreted=False
        )
        if config.kernel == "decode_partition":
            constants["PARTITION_SIZE"] = config.partition_size
            fn = kernels.paged_decode_partition_kernel
        else:
            fn = kernels.paged_decode_kernel
    elif config.kernel == "decode_reduce":
        fn, constants = kernels.paged_decode_reduce_kernel, backend.reduce_constants(head_dim, config.partition_size)
    elif config.kernel == "prefill":
        fn = kernels.paged_prefill_kernel
        constants = backend.attention_constants(
            "prefill", dtype, head_dim, kv_heads, config.group_size, config.block_size, interpreted=False
        )
    elif config.kernel == "group_quant_gemm":
        from . import quant_gemm

        fn = quant_gemm.group_quant_gemm_kernel
        constants = quant_gemm.gemm_constants(
            dtype, config.bits, config.group_size, config.num_rows, interpreted=False
        )
    elif config.kernel in LORA_KERNELS:
        from . import triton_lora

        if config.kernel == "lora_shrink":
            fn, constants = triton_lora.lora_shrink_kernel, triton_lora.shrink_constants(config.lora_width)
        else:
            fn, constants = triton_lora.lora_expand_kernel, triton_lora.expand_constants()
    elif config.kernel == "reshape_and_cache":
        fn, constants = kernels.reshape_and_cache_kernel, backend.cache_write_constants(
            head_dim, kv_heads, config.block_size
        )
    else:
        raise ValueError(f"unknown kernel {config.kernel!r}; one of {', '.join(KERNELS)}")
    constants = dict(constants)
    if config.kernel in ("decode", "decode_partition", "prefill"):
        constants.update(SLIDING=config.sliding, SOFT_CAP=config.soft_cap)
    elif config.kernel == "decode_reduce":
        constants["SLIDING"] = config.sliding
    num_warps = constants.pop("num_warps")
    qkv_stride = (num_heads + 2 * kv_heads) * head_dim  # a slice of the packed QKV projection
    int_values = {
        "stride_q_token": qkv_stride, "stride_q_head": head_dim, "stride_out_token": num_heads * head_dim,
        "stride_out_head": head_dim, "stride_key_token": qkv_stride, "stride_key_head": head_dim,
        "stride_value_token": qkv_stride, "stride_value_head": head_dim, "num_heads": num_heads,
        "stride_table_seq": 0, "max_partitions": 0, "window": 0,  # do_not_specialize: the values never matter
        # group_quant_gemm: a 4096 x 4096 projection (Llama-3-8B's q / o)
        "num_rows": config.num_rows, "out_features": 4096, "in_features": 4096, "stride_x_row": 4096,
        "stride_out_row": 4096, "k_per_split": 2048, "stride_out_split": config.num_rows * 4096,
        # lora kernels: a 4096 x 4096 projection, 16 slots of the config's rank width
        "lora_width": config.lora_width, "stride_a_slot": config.lora_width * 4096,
        "stride_b_slot": config.lora_width * 4096, "stride_y_row": 4096,
    }
    not_specialized = not_specialized_arguments(fn)
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _POINTER_TYPES.get(name, "*" + _TRITON_DTYPES[config.dtype])
            if config.kernel == "group_quant_gemm" and name == "out_ptr":  # the decode tile's float32 partials
                from .quant_gemm import out_dtype

                out = str(out_dtype(config.num_rows, config.torch_dtype)).removeprefix("torch.")
                signature[name] = "*" + _TRITON_DTYPES[out]
            attrs[(index,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif name in ("scale_log2", "cap_log2"):
            signature[name] = "fp32"
        else:
            value = int_values[name]  # KeyError: a new runtime argument needs a representative value
            signature[name] = "i32"
            if name not in not_specialized and value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return fn, signature, constants, attrs, num_warps


def not_specialized_arguments(fn) -> set[str]:
    """The names in a kernel's do_not_specialize (a jitted or an interpreted kernel)."""
    listed = getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
    return {fn.arg_names[item] if isinstance(item, int) else item for item in listed}


def compile_config(config: KernelConfig, target: Target) -> dict:
    """Compile one configuration for one target; shared memory, registers, spills, loads."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, signature, constants, attrs, num_warps = launch_spec(config)
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(fn, signature, constants, attrs),
        target=GPUTarget("cuda", target.capability, 32),
        options=dict(num_warps=num_warps),
    )
    ptx = compiled.asm["ptx"]
    registers, spill_bytes = ptxas_usage(ptx, target.capability)
    widest, vector_loads = global_read_widths(ptx)
    return dict(
        asdict(config), target=target.name, num_warps=num_warps, smem=int(compiled.metadata.shared),
        smem_limit=target.smem_limit, registers=registers, spill_bytes=spill_bytes, widest_load_bits=widest,
        vector_loads=vector_loads, seconds=round(time.perf_counter() - start, 2),
    )


def global_read_widths(ptx: str) -> tuple[int, int]:
    """(widest global read in bits, number of reads of 64 bits or more): ld.global loads and
    cp.async global -> shared copies (how the compiler pipelines K/V tiles on sm_80+)."""
    widths = [
        int(bits) * int((vector or "v1")[1:])
        for vector, bits in re.findall(r"ld\.global(?:\.[a-z]+)*?(?:\.(v[248]))?\.[bfsu](\d+)", ptx)
    ]
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)", ptx)
    widths += [8 * int(size, 0) for size in copies]
    return max(widths, default=0), sum(1 for width in widths if width >= 64)


def ptxas_usage(ptx: str, capability: int) -> tuple[int, int]:
    """(registers per thread, spill store bytes) from the ptxas bundled with triton."""
    ptxas = _ptxas_path(capability)
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        result = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name={arch}", str(source), "-o", str(source.with_suffix(".cubin"))],
            capture_output=True, text=True, check=False,
        )
    if result.returncode:
        raise RuntimeError(f"ptxas failed for {arch}: {result.stderr.strip()[-500:]}")
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    if registers is None or spills is None:
        raise RuntimeError(f"cannot read registers / spills from ptxas -v: {result.stderr[-500:]}")
    return int(registers.group(1)), int(spills.group(1))


def _ptxas_path(capability: int) -> Path:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    # triton compiles sm_90+ with the newer ptxas where it ships one (its PTX version needs it)
    names = ("ptxas-blackwell", "ptxas") if capability >= 90 else ("ptxas",)
    for name in names:
        if (bin_dir / name).exists():
            return bin_dir / name
    raise RuntimeError(f"no ptxas in {bin_dir}")


# ---------------------------------------------------------------------------- many compiles


def _compile_job(job: tuple[KernelConfig, Target]) -> dict:
    config, target = job
    try:
        return compile_config(config, target)
    except Exception as error:  # reported per configuration, never hides the others
        return dict(asdict(config), target=target.name, error=f"{type(error).__name__}: {error}"[:2000])


def compile_all(configs=None, targets=TARGETS, jobs: int | None = None) -> list[dict]:
    """Compile every (config, target) (configs None: ci_configs(target) for each target; a
    dict: its list per target name) in worker processes started fresh (spawn), so that a
    TRITON_INTERPRET=1 set in this process (the interpreter tests) cannot reach them."""
    import multiprocessing

    if isinstance(configs, dict):  # per target name
        work = [(config, target) for target in targets for config in configs[target.name]]
    else:
        work = [(config, target) for target in targets for config in (configs or ci_configs(target))]
    # the slow compiles first, so the last worker does not start one alone at the end
    work.sort(key=lambda job: (job[0].dtype != "float32", job[0].kernel not in ("prefill", "decode")))
    jobs = jobs or max(1, min(len(os.sched_getaffinity(0)), 4))
    env_before = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_compile_job, work, chunksize=1))
    finally:
        if env_before is not None:
            os.environ["TRITON_INTERPRET"] = env_before
    return results


def problems(result: dict) -> list[str]:
    """What the compile check rejects in one result."""
    if "error" in result:
        return [f"does not compile: {result['error']}"]
    found = []
    if result["smem"] > result["smem_limit"]:
        found.append(f"shared memory {result['smem']} B > {result['smem_limit']} B")
    attention = result["kernel"] in ("decode", "decode_partition", "prefill")
    if attention and result["dtype"] != "float32" and result["spill_bytes"]:
        found.append(f"{result['spill_bytes']} bytes of register spills")
    if attention and result["widest_load_bits"] < 128:
        found.append(f"widest global read {result['widest_load_bits']} bits: K/V are not read in 16-byte vectors")
    return found


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| kernel | dtype | head | group | block | kv heads | partition | target | warps | smem KB (limit) "
        "| registers | spills B | widest load | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {name: i for i, name in enumerate(KERNELS)}
    for r in sorted(results, key=lambda r: (order[r["kernel"]], r["dtype"], r["head_dim"], r["target"])):
        if "error" in r:
            head = f"| {r['kernel']} | {r['dtype']} | {r['head_dim']} |"
            lines.append(f"{head} | | | | {r['target']} | | error | | | | |")
            continue
        lines.append(
            f"| {r['kernel']} | {r['dtype']} | {r['head_dim']} | {r['group_size']} | {r['block_size']} "
            f"| {r['num_kv_heads']} | {r['partition_size'] or '-'} | {r['target']} | {r['num_warps']} "
            f"| {r['smem'] / KB:.1f} ({r['smem_limit'] // KB}) | {r['registers']} | {r['spill_bytes']} "
            f"| {r['widest_load_bits']} bit | {r['seconds']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rayserve_paged.ops.triton_aot", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--jobs", type=int, default=None, help="compiler processes (default: CPUs, at most 4)")
    parser.add_argument("--markdown", action="store_true", help="print the docs/KERNELS.md table")
    parser.add_argument("--kernel", action="append", choices=KERNELS, help="only these kernels")
    parser.add_argument("--dtype", action="append", choices=[str(d).removeprefix("torch.") for d in DTYPES],
                        help="only these dtypes")
    parser.add_argument("--target", action="append", choices=[t.name for t in TARGETS], help="only these targets")
    args = parser.parse_args(argv)
    targets = [t for t in TARGETS if not args.target or t.name in args.target]
    start = time.perf_counter()
    configs = {
        target.name: [
            c for c in ci_configs(target)
            if (not args.kernel or c.kernel in args.kernel) and (not args.dtype or c.dtype in args.dtype)
        ]
        for target in targets
    }
    results = compile_all(configs, targets, args.jobs)
    elapsed = time.perf_counter() - start
    bad = [(r, p) for r in results for p in problems(r)]
    if args.markdown:
        print(markdown_table(results))
    for result, problem in bad:
        print(f"FAIL {result['kernel']} {result['dtype']} head {result['head_dim']} {result['target']}: {problem}")
    cpu_s = sum(r.get("seconds", 0) for r in results)
    print(f"{len(results)} compiles in {elapsed:.0f} s wall ({cpu_s:.0f} s of compiler time), {len(bad)} problems",
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
