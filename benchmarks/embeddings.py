"""Embedding throughput and the cost of prompt logprobs, on CPU, with a random Qwen3-shaped model.

  engine      LLM.embed over every passage (last-token pooling, normalized): the engine's
              scheduler batches the prefills under its token budget
  hf          transformers' AutoModel (Qwen3Model) forward in batches of --batch passages
              (right-padded, attention mask), the last real token's hidden state, normalized
  prefill     the engine generating 1 token per passage, without and with prompt_logprobs=1

Figures: inputs/s and prompt tokens/s (wall time of the whole run, after an untimed pass
over every passage that warms the engine and its KV pool). Passages are random token ids
of --tokens +- 10% tokens; the prefix cache is off (the runs embed the same passages: a
cache would serve the later ones).
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.options import benchmark_parser
from benchmarks.records import print_rows, progress, write_record
from rayserve_paged import LLM, PoolingParams, SamplingParams
from rayserve_paged.models.tiny import write_tokenizer


def write_model(out_dir: Path, hidden: int, layers: int, seed: int) -> Path:
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(config).float().save_pretrained(out_dir)
    write_tokenizer(out_dir, config.max_position_embeddings)
    return out_dir


def hf_embed(path: Path, passages: list[list[int]], batch: int) -> float:
    """Seconds for HF AutoModel to embed every passage in batches of `batch`."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(passages), batch):
            chunk = passages[i : i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in chunk])  # [b, width]
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in chunk])
            states = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [b, width, hidden]
            last = states[torch.arange(len(chunk)), mask.sum(1) - 1]
            torch.nn.functional.normalize(last, dim=-1)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("rayserve-paged bench embeddings", __doc__.splitlines()[0], out_help="record folder")
    parser.add_argument("--passages", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for both (a shared machine: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.passages, args.tokens, args.hidden, args.layers = 8, 40, 128, 1
    rng = random.Random(args.seed)
    lengths = [rng.randint(int(args.tokens * 0.9), int(args.tokens * 1.1)) for _ in range(args.passages)]
    passages = [[1] + [rng.randrange(3, 4096) for _ in range(n - 1)] for n in lengths]
    num_tokens = sum(lengths)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp), args.hidden, args.layers, args.seed)
        llm = LLM(
            model=str(path), device="cpu", max_model_len=512, kv_cache_memory_gb=0.1,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256, enable_prefix_caching=False,
            num_cpu_threads=args.threads,
        )  # fmt: skip
        # warm-up: the first pass over the KV pool touches its fresh pages (timed, it costs the first case alone)
        llm.generate(prompt_token_ids=passages, sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
        results = {}

        def timed(name: str, fn) -> None:
            progress(f"{name} ...")
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
            results[name] = {"seconds": round(seconds, 3), "inputs_per_s": round(args.passages / seconds, 1),
                             "tokens_per_s": round(num_tokens / seconds)}  # fmt: skip

        embed = PoolingParams()  # last token, normalized
        timed("engine_embed", lambda: llm.embed(prompt_token_ids=passages, pooling_params=embed, use_tqdm=False))
        progress("hf_embed ...")
        seconds = hf_embed(path, passages, args.batch)
        results[f"hf_automodel_batch{args.batch}"] = {
            "seconds": round(seconds, 3), "inputs_per_s": round(args.passages / seconds, 1),
            "tokens_per_s": round(num_tokens / seconds),
        }  # fmt: skip
        plain = SamplingParams(max_tokens=1, temperature=0.0)
        scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        timed("prefill_1_token", lambda: llm.generate(prompt_token_ids=passages, sampling_params=plain, use_tqdm=False))
        timed("prefill_1_token_prompt_logprobs", lambda: llm.generate(
            prompt_token_ids=passages, sampling_params=scored, use_tqdm=False))  # fmt: skip
    print_rows(f"{args.passages} passages of ~{args.tokens} tokens, Qwen3-shaped hidden {args.hidden} x "
               f"{args.layers} layers, float32 CPU", results, 32)  # fmt: skip
    if args.out:
        write_record(args.out, "embeddings", results, args=vars(args))
    return 0
