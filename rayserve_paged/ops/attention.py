"""The attention contract between the model runner and the kernels.

One step's tokens are packed prefill-first:

    tokens   [ prefill seq 0 new tokens | prefill seq 1 new tokens | ... | decode 0 | decode 1 | ... ]
             <-------------- num_prefill_tokens -------------------->  <-- num_decode_tokens -->

A "prefill" sequence computes one or more new tokens that attend causally to themselves and
to the sequence's cached context (prefix-cache hits, recompute after preemption); a
"decode" sequence computes exactly one token over its whole cached context.

Invariant every backend keeps: in each layer the step's new K/V are written into the
cache (through `slot_mapping`) before any attention of that step reads the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_SLOT = -1  # slot_mapping entry for a padding token: nothing is written


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer (all on one device)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset, or PAD_SLOT
    num_prefill_tokens: int
    num_decode_tokens: int
    block_size: int
    # prefill part (num_prefills sequences)
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32: cumulative new-token counts
    prefill_context_lens: torch.Tensor  # [num_prefills] int32: tokens already cached before the step
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32: context + new tokens
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32, padded with 0
    max_prefill_query_len: int
    max_prefill_seq_len: int
    # decode part (num_decode_tokens sequences, one token each)
    decode_seq_lens: torch.Tensor  # [num_decodes] int32: context including the new token
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, padded with 0
    max_decode_seq_len: int
    # host copies for backends that loop in Python (the torch reference)
    prefill_query_lens_host: list[int] | None = None
    prefill_seq_lens_host: list[int] | None = None
    decode_seq_lens_host: list[int] | None = None
    # [num_tokens] int64, only for models whose RoPE depends on a length (dynamic NTK,
    # LongRoPE): per token, the length of the forward transformers computes it in,
    # max(num_prompt_tokens, position + 1)
    rope_lens: torch.Tensor | None = None

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_context_lens.shape[0])

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seq_lens.shape[0])
