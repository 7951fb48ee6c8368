"""gpu_check's end-to-end check: the model runner without the engine (load_model +
ModelRunner: no pydantic, no ray), then the engine path users run (LLM -> LLMEngine ->
InProcessExecutor -> Worker), each against HF generate. benchmarks/gpu_check.py runs it;
its docstring has the plan."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_kernels import CUDA, free_memory

# The checkpoint every model section shares on the GPU: OPT-1.3B's width (hidden 2048, ffn
# 8192, 32 heads of 64) with 4 layers and the tiny 512-token vocabulary, random weights in
# float16: 0.4 GB, written in about 2 s (the 24-layer float32 one was 4.8 GB, written twice)
SMALL_OPT = dict(
    hidden_size=2048, num_hidden_layers=4, ffn_dim=8192, num_attention_heads=32, word_embed_proj_dim=2048,
    max_position_embeddings=2048, dtype="float16",
)


class Checkpoints:
    """The one checkpoint the runner and engine sections share, written on first use under
    `root` (which the caller removes): SMALL_OPT on CUDA, the tiny float32 OPT on CPU."""

    def __init__(self, root: Path, has_cuda: bool) -> None:
        self.root, self.has_cuda = Path(root), has_cuda
        self._path: str | None = None
        self.write_seconds: float | None = None

    def path(self) -> str:
        if self._path is None:
            from rayserve_paged.models.tiny import make_tiny_model

            started = time.monotonic()
            self._path = str(make_tiny_model("opt", self.root / "opt", **(SMALL_OPT if self.has_cuda else {})))
            self.write_seconds = round(time.monotonic() - started, 2)
        return self._path


def checkpoint_name(has_cuda: bool) -> str:
    return "random-weight OPT-1.3B-wide, 4 layers, float16" if has_cuda else "tiny OPT (CPU)"


@contextlib.contextmanager
def checkpoint_of(context: Checkpoints | None, has_cuda: bool):
    """The shared checkpoint's path; without a context, one of its own, removed after."""
    if context is not None:
        yield context.path()
        return
    root = Path(tempfile.mkdtemp(prefix="gpu-check-model-"))
    try:
        yield Checkpoints(root, has_cuda).path()
    finally:
        shutil.rmtree(root, ignore_errors=True)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Paged attention keeps the cache in blocks",
    "Hello",
    "A much longer prompt that runs across more than one block of sixteen tokens, "
    "so that the block tables of this batch have different lengths and shapes",
]


# ---------------------------------------------------------------------------- model runner end to end
#
# Only torch, triton, transformers and safetensors: the model, the ModelRunner, the kernels,
# the swapper and the KV sizing, driven by a minimal greedy loop (no scheduler, no engine
# configuration, so neither pydantic nor ray is imported).


def runner_check(torch, has_cuda: bool, quick: bool, cpu_backend: str = "triton", context=None) -> dict:
    """Greedy tokens of the model runner against HF generate in float32 (triton backend on
    the GPU; torch and the interpreted kernels on CPU), the same run with every block swapped
    out to pinned host memory and back into other blocks halfway, the KV cache sized from
    gpu_memory_utilization, no kernel compile after warm-up, and fp16 / bf16 decode
    throughput of the runner."""
    from transformers import AutoModelForCausalLM

    from rayserve_paged.models.loader import get_model_config, load_model
    from rayserve_paged.models.sampler import Sampler
    from rayserve_paged.ops import triton_backend
    from rayserve_paged.ops.backends import get_attention_backend
    from rayserve_paged.ops.cache_ops import BlockSwapper
    from rayserve_paged.worker.model_runner import ModelRunner
    from rayserve_paged.worker.static_decode import StaticDecode

    device = CUDA if has_cuda else "cpu"
    backend_name = "triton" if has_cuda or (cpu_backend == "triton" and triton_backend.is_interpreted()) else "torch"
    block_size, max_new = 16, (16 if quick or not has_cuda else 32)
    result: dict = {"device": device, "backend": backend_name, "failures": []}
    with checkpoint_of(context, has_cuda) as path:
        mc = get_model_config(path)
        backend = get_attention_backend(backend_name, device)
        tokenizer_ids = _prompt_ids(path)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        eos_ids = set(mc.eos_token_ids)
        expected = [hf_greedy(hf_model, torch, ids, max_new, eos_ids) for ids in tokenizer_ids]
        del hf_model
        free_memory(torch)
        for dtype in ("float32", "float16", "bfloat16") if has_cuda else ("float32",):
            model = load_model(path, dtype, device, backend)
            eos = tuple(mc.eos_token_ids)
            runner = ModelRunner(model, block_size, torch.device(device), Sampler(len(eos), eos))
            blocks_per_seq = -(-(max(map(len, tokenizer_ids)) + max_new) // block_size)
            num_blocks = profile_cache_blocks(2 * len(tokenizer_ids), blocks_per_seq)  # twice: the swap round trip
            if has_cuda and dtype == "float32":
                result["kv_sizing"] = kv_sizing(torch, runner, mc, backend, block_size, dtype)
            caches = _caches(torch, mc, num_blocks, block_size, getattr(torch, dtype), device)
            host = _caches(torch, mc, num_blocks, block_size, getattr(torch, dtype), "cpu", pin=has_cuda)
            compiled_before = None
            qkv_stride = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim  # queries: slices of one QKV projection
            if has_cuda:
                started = time.monotonic()
                result.setdefault("warm_up", {})[dtype] = {
                    "variants": backend.warm_up(*caches[0], mc.num_heads, qkv_stride),
                    "seconds": round(time.monotonic() - started, 2),
                }
                compiled_before = compiled_variants()
            ours = [_cut_at_eos(tokens, eos_ids) for tokens in
                    runner_greedy(runner, caches, tokenizer_ids, max_new, block_size, blocks_per_seq)]
            # the static-shape decode path: 4 prompts in buckets 1, 2, 4 (graphs on CUDA)
            runner.static_decode = StaticDecode(
                model, block_size, len(tokenizer_ids), mc.max_model_len, device, backend
            )
            result.setdefault("static_decode_graphs", {})[dtype] = runner.static_decode.capture(caches)
            static = [_cut_at_eos(tokens, eos_ids) for tokens in
                      runner_greedy(runner, caches, tokenizer_ids, max_new, block_size, blocks_per_seq)]
            result.setdefault("static_decode_runs", {})[dtype] = dict(runner.static_decode.runs)
            runner.static_decode = None
            result.setdefault("static_decode_equal", {})[dtype] = static == ours
            if static != ours and dtype == "float32":
                result["failures"].append("float32: the static-shape decode path's tokens differ from the eager path's")
            swapper = BlockSwapper(caches, host)
            swapped = [_cut_at_eos(tokens, eos_ids) for tokens in
                       runner_greedy(runner, caches, tokenizer_ids, max_new, block_size, blocks_per_seq, swapper)]
            if dtype == "float32":
                exact = sum(a == b for a, b in zip(ours, expected))
                result["hf_parity_float32"] = {"prompts": len(expected), "exact": exact}
                if ours != expected:
                    result["failures"].append("float32 greedy tokens differ from HF")
            result.setdefault("swap_roundtrip_equal", {})[dtype] = swapped == ours
            if swapped != ours:
                result["failures"].append(f"{dtype}: tokens after a swap-out / swap-in differ")
            if has_cuda:
                result.setdefault("decode_tokens_per_s", {})[dtype] = runner_throughput(
                    torch, runner, caches, mc, block_size, quick, backend
                )
                compiled_after = compiled_variants()
                result.setdefault("compiles_after_warm_up", {})[dtype] = (
                    None if compiled_before is None or compiled_after is None else compiled_after - compiled_before
                )
                if compiled_before is not None and compiled_after is not None and compiled_after != compiled_before:
                    extra = compiled_after - compiled_before
                    result["failures"].append(f"{dtype}: {extra} kernel compiles after warm-up")
            del model, runner, caches, host
            free_memory(torch)
    result["model"] = checkpoint_name(has_cuda)
    return result


def _cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """The tokens up to and including the first EOS, as HF generate returns them."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def _prompt_ids(path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]


def _caches(torch, mc, num_blocks, block_size, dtype, device, pin=False):
    shape = (num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin),
         torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin))
        for _ in range(mc.num_layers)
    ]


def runner_greedy(runner, caches, prompts, max_new, block_size, blocks_per_seq, swapper=None) -> list[list[int]]:
    """Greedy decoding of every prompt in one batch through ModelRunner.execute. Sequence i
    owns blocks [1 + i * blocks_per_seq, ...); with a swapper, halfway through every
    sequence's blocks go out to the host pool and come back into the other half of the pool."""
    from rayserve_paged.core.outputs import NewRequest, StepMessage
    from rayserve_paged.core.sequence import SamplingParams

    num_blocks = caches[0][0].shape[0]
    needed = profile_cache_blocks(len(prompts) * (2 if swapper is not None else 1), blocks_per_seq)
    if needed > num_blocks:  # no kernel checks block ids: an id past the pool reads and writes out of bounds
        raise ValueError(f"runner_greedy: the tables need {needed} cache blocks (block 0 unused), the cache has {num_blocks}")
    longest = max(map(len, prompts)) + max_new - 1  # tokens cached before the last step
    if longest > blocks_per_seq * block_size:
        raise ValueError(f"runner_greedy: {longest} tokens do not fit {blocks_per_seq} blocks of {block_size}")
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    ids = [f"greedy-{i}-{id(outputs)}" for i in range(len(prompts))]
    rows = list(range(len(prompts)))
    for step in range(max_new):
        msg = StepMessage(seq_ids=rows)
        if step == 0:
            msg.new_requests = [NewRequest(ids[i], i, params, len(prompt)) for i, prompt in enumerate(prompts)]
            msg.block_table_updates = [(i, 0, tables[i]) for i in rows]
            msg.start_positions = [0 for _ in rows]
            msg.num_query_tokens = [len(prompt) for prompt in prompts]
            msg.token_ids = [token for prompt in prompts for token in prompt]
            msg.first_step_seq_ids = rows
        else:
            if swapper is not None and step == max_new // 2:
                offset = len(prompts) * blocks_per_seq
                swapper.swap_out([(block, block) for table in tables for block in table])
                swapper.swap_in([(block, block + offset) for table in tables for block in table])
                tables = [[block + offset for block in table] for table in tables]
                msg.block_table_updates = [(i, 0, tables[i]) for i in rows]
            msg.start_positions = [len(prompt) + step - 1 for prompt in prompts]
            msg.num_query_tokens = [1 for _ in rows]
            msg.token_ids = [out[-1] for out in outputs]
        samples = runner.execute(msg, caches).samples
        for i, sample in enumerate(samples):
            outputs[i].append(sample.token_ids[0])
    runner.execute(StepMessage(finished_request_ids=ids), caches)
    if swapper is not None:
        swapper.finish()
    return outputs


def runner_throughput(torch, runner, caches, mc, block_size, quick: bool, backend) -> dict:
    """Tokens per second of the runner for a batch of random prompts (one prefill step, then
    decode steps), with CUDA graphs off (eager on the exact batch) and on (StaticDecode with
    a graph per bucket up to the batch, captured on these caches), the tokens of the two
    runs compared, and the memory the graphs hold against StaticDecode.profile_bytes (what
    the worker's KV sizing reserves for them)."""
    import random

    from rayserve_paged.worker.static_decode import StaticDecode

    rng = random.Random(0)
    batch, prompt_len, steps = (16, 128, 16) if quick else (64, 256, 32)
    prompts = [[rng.randrange(7, 512) for _ in range(prompt_len)] for _ in range(batch)]
    blocks_per_seq = -(-(prompt_len + steps) // block_size)
    if profile_cache_blocks(batch, blocks_per_seq) > caches[0][0].shape[0]:
        bigger = _caches(torch, mc, profile_cache_blocks(batch, blocks_per_seq), block_size, caches[0][0].dtype, CUDA)
    else:
        bigger = caches
    result: dict = {"batch": batch, "prompt_len": prompt_len, "new_tokens": steps}
    tokens = {}
    for mode in ("graphs_off", "graphs_on"):
        runner.static_decode = None
        if mode == "graphs_on":
            static = StaticDecode(runner.model, block_size, batch, mc.max_model_len, CUDA, backend)
            reserved = static.profile_bytes(bigger)
            torch.cuda.synchronize()
            before, started = torch.cuda.memory_allocated(), time.perf_counter()
            result["graph_buckets"] = static.capture(bigger)
            result["capture_seconds"] = round(time.perf_counter() - started, 2)
            held = torch.cuda.memory_allocated() - before
            result["graph_memory_mib"] = {"held": round(held / 2**20, 1), "reserved": round(reserved / 2**20, 1)}
            result["graph_reserve_covers_capture"] = held <= reserved
            runner.static_decode = static
        torch.cuda.synchronize()
        started = time.perf_counter()
        tokens[mode] = runner_greedy(runner, bigger, prompts, steps, block_size, blocks_per_seq)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        result[mode] = {"seconds": round(seconds, 3), "tokens_per_s": round(batch * steps / seconds, 1)}
        if mode == "graphs_on":
            result["graph_replays"] = runner.static_decode.runs["graph"]
    runner.static_decode = None
    result["graphs_on_over_off"] = round(result["graphs_off"]["seconds"] / result["graphs_on"]["seconds"], 3)
    result["tokens_equal_rows"] = sum(a == b for a, b in zip(tokens["graphs_off"], tokens["graphs_on"]))
    return result


def kv_sizing(torch, runner, mc, backend, block_size, dtype) -> dict:
    """Blocks the KV cache gets from gpu_memory_utilization=0.9 after a 2048-token profile step,
    with the decode workspace and the CUDA graphs of max_num_seqs=256 reserved (as the worker
    does)."""
    from rayserve_paged.worker.kv_sizing import kv_cache_budget_bytes
    from rayserve_paged.worker.static_decode import StaticDecode

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free_before, total = torch.cuda.mem_get_info()
    blocks_per_seq = 2048 // block_size
    # block 0 is never handed out (runner_greedy's tables start at block 1), as in the other callers
    caches = _caches(torch, mc, profile_cache_blocks(1, blocks_per_seq), block_size, getattr(torch, dtype), CUDA)
    runner_greedy(runner, caches, [[7] * 2047], 1, block_size, blocks_per_seq)
    torch.cuda.synchronize()
    allocated, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    workspace = backend.decode_workspace_bytes(256, mc.num_heads, mc.num_kv_heads, mc.head_dim, 2048, CUDA)
    graphs = StaticDecode(runner.model, block_size, 256, 2048, CUDA, backend).profile_bytes(caches)
    budget = kv_cache_budget_bytes(total, free_before, allocated, peak, 0.9, workspace, cuda_graph_bytes=graphs)
    element_size = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    block_bytes = 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * element_size
    num_blocks = max(budget // block_bytes, 0)
    del caches
    torch.cuda.empty_cache()
    allocated = _caches(torch, mc, num_blocks, block_size, getattr(torch, dtype), CUDA)  # must fit
    used = torch.cuda.mem_get_info()
    del allocated
    torch.cuda.empty_cache()
    return {"gpu_memory_utilization": 0.9, "budget_gib": budget / 2**30, "num_blocks": num_blocks,
            "decode_workspace_mib": workspace / 2**20, "cuda_graph_reserve_mib": graphs / 2**20,
            "free_after_allocation_gib": used[0] / 2**30}


def profile_cache_blocks(num_seqs: int, blocks_per_seq: int) -> int:
    """Cache blocks for runner_greedy's tables: sequence i owns blocks
    [1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq), so the pool needs one block more
    than the sequences hold (block 0 stays unused)."""
    return 1 + num_seqs * blocks_per_seq


def compiled_variants() -> int | None:
    """How many compiled variants the attention kernels hold (triton's in-memory caches);
    None when this triton keeps them where this cannot count them."""
    from rayserve_paged.ops import triton_kernels

    total = 0
    for name in ("paged_decode_kernel", "paged_decode_partition_kernel", "paged_decode_reduce_kernel",
                 "paged_prefill_kernel", "reshape_and_cache_kernel"):
        kernel = getattr(triton_kernels, name)
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        for entry in caches.values():
            first = entry[0] if isinstance(entry, tuple) else entry
            if not isinstance(first, dict):
                return None
            total += len(first)
    return total


# ---------------------------------------------------------------------------- end to end


def hf_greedy(model, torch, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """HF generate on one unpadded prompt; the new tokens, cut after the first EOS."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids], device=device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        )
    new = out[0, len(prompt_ids) :].tolist()
    for i, token in enumerate(new):
        if token in eos_ids:
            return new[: i + 1]
    return new


def compare_with_hf(llm, hf_model, torch, max_tokens: int) -> dict:
    from rayserve_paged import SamplingParams

    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    eos = hf_model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    exact, common, total = 0, 0, 0
    for output in outputs:
        ours = output.outputs[0].token_ids
        theirs = hf_greedy(hf_model, torch, output.prompt_token_ids, max_tokens, eos_ids)
        exact += ours == theirs
        prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        common += prefix
        total += max(len(ours), len(theirs))
    return {
        "prompts": len(outputs), "exact_match_rate": exact / len(outputs),
        "token_match_rate": common / max(total, 1), "max_tokens": max_tokens,
    }


def throughput(llm, num_prompts: int, prompt_len: int, max_tokens: int, sync) -> dict:
    import random

    from rayserve_paged import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(7, 512) for _ in range(prompt_len)] for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=params, use_tqdm=False)  # warm-up
    sync()
    started = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "num_prompts": num_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens, "seconds": seconds,
        "output_tokens_per_s": generated / seconds,
        "total_tokens_per_s": (generated + num_prompts * prompt_len) / seconds,
    }


def e2e_gpu(torch, quick: bool, context=None) -> dict:
    """The engine on the shared float16 checkpoint: CUDA graphs on (the KV cache profiled)
    and enforce_eager with the triton backend (the full run adds the torch backend)."""
    num_prompts = 16 if quick else 64
    # max_num_seqs = the load's batch: graphs for buckets 1..num_prompts only, and one length
    # class (max_model_len 1024 holds the load's 256 + 128 tokens)
    common = dict(dtype="float16", device="auto", max_model_len=1024, swap_space_gb=1, max_num_seqs=num_prompts)
    runs = {
        # CUDA graphs on, the KV cache sized the way a user's start-up sizes it: profiled
        "triton": common | dict(attention_backend="triton", gpu_memory_utilization=0.3),
        "triton:eager": common | dict(attention_backend="triton", enforce_eager=True, kv_cache_memory_gb=16),
    }
    if not quick:
        runs["torch"] = common | dict(attention_backend="torch", kv_cache_memory_gb=16)
    with checkpoint_of(context, True) as path:
        result = e2e_run(
            torch, path, device="cuda", dtype="float16", runs=runs, parity_tokens=16 if quick else 32,
            load=dict(num_prompts=16, prompt_len=128, max_tokens=64) if quick
            else dict(num_prompts=64, prompt_len=256, max_tokens=128),
        )
    result |= {"model": checkpoint_name(True), "config": SMALL_OPT}
    if context is not None:
        result["checkpoint_seconds"] = context.write_seconds
    if "throughput_torch" in result:
        result["triton_over_torch_tokens_per_s"] = (
            result["throughput_triton"]["output_tokens_per_s"] / result["throughput_torch"]["output_tokens_per_s"]
        )
    result["cuda_graphs_over_eager_tokens_per_s"] = (
        result["throughput_triton"]["output_tokens_per_s"] / result["throughput_triton:eager"]["output_tokens_per_s"]
    )
    return result


def e2e_cpu(torch, context=None) -> dict:
    """The tiny OPT on CPU through the engine: the torch backend with the static decode path
    (padded buckets, eager: no CUDA) and with enforce_eager, and the triton kernels under
    the interpreter; float32 greedy tokens must equal HF's."""
    from rayserve_paged.ops import triton_backend

    common = dict(dtype="float32", device="auto", kv_cache_memory_gb=0.05, max_model_len=256, swap_space_gb=0.01)
    runs = {"torch": common | dict(attention_backend="torch"),
            "torch:eager": common | dict(attention_backend="torch", enforce_eager=True)}
    if triton_backend.is_interpreted():
        runs["triton"] = common | dict(attention_backend="triton")
    with checkpoint_of(context, False) as path:
        result = e2e_run(
            torch, path, device="cpu", dtype="float32", runs=runs, parity_tokens=12,
            load=dict(num_prompts=4, prompt_len=24, max_tokens=8),
        )
    result["model"] = "tiny OPT (hidden 64, 2 layers, 4 heads, head 16), CPU"
    if "triton" not in runs:
        result["triton_skipped"] = "the kernels were imported without TRITON_INTERPRET=1"
    for label in runs:
        if result[f"hf_parity_{label}"]["exact_match_rate"] != 1.0:
            result["failures"].append(f"{label}: float32 greedy tokens differ from HF")
    return result


def e2e_run(torch, path, *, device, dtype, runs: dict[str, dict], parity_tokens, load) -> dict:
    """Greedy parity with HF (same dtype), throughput and the engine path each run took, for
    each run's engine options (`LLM(model=path, **options)`)."""
    from transformers import AutoModelForCausalLM

    from rayserve_paged import LLM

    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    result: dict = {"dtype": dtype, "device": device, "failures": []}
    for label, options in runs.items():
        llm = LLM(model=path, **options)
        result[f"hf_parity_{label}"] = compare_with_hf(llm, hf_model, torch, max_tokens=parity_tokens)
        result[f"throughput_{label}"] = throughput(llm, **load, sync=sync)
        path_taken = result[f"engine_path_{label}"] = engine_path(llm)
        result["failures"] += [f"{label}: {problem}" for problem in engine_path_problems(path_taken, options, device)]
        del llm
        free_memory(torch)
    del hf_model
    free_memory(torch)
    return result


def engine_path(llm) -> dict:
    """What the engine built: its executor and worker, the worker's device, its KV pool, the
    decode graphs it captured and the steps each decode path ran."""
    executor = llm.engine.executor
    worker = executor.worker
    static = worker.runner.static_decode
    return {
        "engine": type(llm.engine).__name__, "executor": type(executor).__name__, "worker": type(worker).__name__,
        "device": str(worker.device), "num_gpu_blocks": llm.engine.cache_sizes.num_gpu_blocks,
        "cuda_graphs": list(worker.cuda_graphs), "static_decode_runs": None if static is None else dict(static.runs),
        "warmed_up_variants": len(worker.warmed_up),
    }


def engine_path_problems(path: dict, options: dict, device: str) -> list[str]:
    """Where the engine did not take the path the options ask for."""
    problems = []
    if (path["engine"], path["executor"], path["worker"]) != ("LLMEngine", "InProcessExecutor", "Worker"):
        problems.append(f"engine path {path['engine']} / {path['executor']} / {path['worker']}")
    expected_device = "cuda:0" if device == "cuda" else "cpu"
    if path["device"] != expected_device:
        problems.append(f"the worker ran on {path['device']}, not {expected_device}")
    runs = path["static_decode_runs"]
    if options.get("enforce_eager"):
        if runs is not None or path["cuda_graphs"]:
            problems.append("enforce_eager, yet a static decode path or CUDA graphs were built")
    elif runs is None:
        problems.append("no static decode path without enforce_eager")
    elif device == "cuda" and options.get("attention_backend") == "triton":
        if not path["cuda_graphs"] or runs["graph"] == 0:
            problems.append(f"CUDA graphs on, yet graphs {path['cuda_graphs']} and {runs['graph']} graph replays")
    elif runs["eager"] == 0:
        problems.append("the static decode path ran no step")
    return problems


# ---------------------------------------------------------------------------- report


def report_lines(report: dict) -> list[str]:
    """The summary table's lines of the runner and engine sections."""
    return _runner_lines(report.get("runner")) + _e2e_lines(report.get("e2e"))


def _e2e_lines(e2e: dict | None) -> list[str]:
    if not e2e:
        return []
    lines = [f"e2e               {e2e['model']}, {e2e['dtype']}"]

    def label(backend: str) -> str:
        return "triton (interpreter)" if backend == "triton" and e2e.get("device") == "cpu" else backend

    for key, value in sorted(e2e.items()):
        if key.startswith("hf_parity_"):
            backend = label(key.removeprefix("hf_parity_"))
            lines.append(
                f"  vs HF greedy    {backend}: {value['exact_match_rate']:.0%} of {value['prompts']} prompts exact, "
                f"{value['token_match_rate']:.0%} of tokens"
            )
        elif key.startswith("throughput_"):
            backend = label(key.removeprefix("throughput_"))
            lines.append(
                f"  tokens/s        {backend}: {value['output_tokens_per_s']:.1f} output "
                f"tokens/s ({value['num_prompts']} prompts x {value['max_tokens']} tokens)"
            )
        elif key.startswith("engine_path_"):
            backend = label(key.removeprefix("engine_path_"))
            runs = value["static_decode_runs"]
            lines.append(
                f"  engine path     {backend}: {value['executor']} -> {value['worker']} on {value['device']}, "
                f"{value['num_gpu_blocks']} KV blocks, graphs {value['cuda_graphs'] or 'none'}, "
                f"static decode {runs if runs is not None else 'off (enforce_eager)'}"
            )
    for failure in e2e.get("failures", []):
        lines.append(f"  FAILED          {failure}")
    if "triton_over_torch_tokens_per_s" in e2e:
        lines.append(f"  triton / torch  {e2e['triton_over_torch_tokens_per_s']:.2f}x output tokens/s")
    if "cuda_graphs_over_eager_tokens_per_s" in e2e:
        lines.append(f"  graphs / eager  {e2e['cuda_graphs_over_eager_tokens_per_s']:.2f}x output tokens/s (triton)")
    return lines


def _runner_lines(runner: dict | None) -> list[str]:
    if not runner:
        return []
    lines = [f"runner            {runner.get('model')}, {runner['backend']} on {runner['device']}"]
    parity = runner.get("hf_parity_float32")
    if parity:
        lines.append(f"  vs HF greedy    float32: {parity['exact']} of {parity['prompts']} prompts exact")
    for dtype, equal in runner.get("static_decode_equal", {}).items():
        graphs = runner.get("static_decode_graphs", {}).get(dtype) or "none (eager on padded rows)"
        lines.append(f"  static decode   {dtype}: tokens {'equal to' if equal else 'DIFFER from'} eager; graphs {graphs}")
    for dtype, row in runner.get("decode_tokens_per_s", {}).items():
        lines.append(
            f"  tokens/s        {dtype}: graphs off {row['graphs_off']['tokens_per_s']:.0f}, on "
            f"{row['graphs_on']['tokens_per_s']:.0f} ({row['graphs_on_over_off']:.2f}x; batch {row['batch']}); "
            f"graph memory {row['graph_memory_mib']['held']} MiB held, {row['graph_memory_mib']['reserved']} reserved"
        )
    for failure in runner.get("failures", []):
        lines.append(f"  FAILED          {failure}")
    return lines
