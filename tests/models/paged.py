"""A minimal stand-in for the model runner: packs steps over a paged KV cache for model tests.

Blocks are handed out from a shuffled free list, so block tables are never the identity and
every read really goes through them.
"""

from __future__ import annotations

import random

import torch

from rayserve_paged.ops.attention import AttentionMetadata


class PagedRunner:
    def __init__(self, model, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 num_blocks: int = 96, block_size: int = 4, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # NaN-filled: a read of a slot never written shows up in the logits.
        self.kv_caches = [
            (torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
            for _ in range(num_layers)
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(0).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}

    def _slots(self, seq_id: int, start: int, count: int) -> list[int]:
        """Make room for tokens [start, start + count) of a sequence; their cache slots."""
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.block_size < start + count:
            table.append(self.free_blocks.pop())
        positions = range(start, start + count)
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in positions]

    def _tables(self, seq_ids: list[int]) -> torch.Tensor:
        width = max([len(self.block_tables[s]) for s in seq_ids], default=1)
        rows = [self.block_tables[s] + [0] * (width - len(self.block_tables[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(seq_ids), width)

    def step(self, prefills: list[tuple[int, list[int]]], decodes: list[tuple[int, int]] = (),
             all_logits: bool = False) -> torch.Tensor:
        """Run one packed step; returns logits of each sequence's last token (prefills first),
        or of every token when all_logits. prefills: (seq_id, new tokens); decodes: (seq_id, token)."""
        input_ids, positions, slots = [], [], []
        query_lens, context_lens = [], []
        for seq_id, tokens in prefills:
            start = self.num_cached.get(seq_id, 0)
            input_ids += tokens
            positions += range(start, start + len(tokens))
            slots += self._slots(seq_id, start, len(tokens))
            query_lens.append(len(tokens))
            context_lens.append(start)
        decode_lens = []
        for seq_id, token in decodes:
            start = self.num_cached[seq_id]
            input_ids.append(token)
            positions.append(start)
            slots += self._slots(seq_id, start, 1)
            decode_lens.append(start + 1)
        prefill_seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_prefill_tokens=sum(query_lens),
            num_decode_tokens=len(decodes),
            block_size=self.block_size,
            prefill_query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
            prefill_context_lens=torch.tensor(context_lens, dtype=torch.int32),
            prefill_seq_lens=torch.tensor(prefill_seq_lens, dtype=torch.int32),
            prefill_block_tables=self._tables([s for s, _ in prefills]),
            max_prefill_query_len=max(query_lens, default=0),
            max_prefill_seq_len=max(prefill_seq_lens, default=0),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32),
            decode_block_tables=self._tables([s for s, _ in decodes]),
            max_decode_seq_len=max(decode_lens, default=0),
            prefill_query_lens_host=query_lens,
            prefill_seq_lens_host=prefill_seq_lens,
            decode_seq_lens_host=decode_lens,
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, metadata)
        for seq_id, tokens in prefills:
            self.num_cached[seq_id] = self.num_cached.get(seq_id, 0) + len(tokens)
        for seq_id, _ in decodes:
            self.num_cached[seq_id] += 1
        if not all_logits:
            ends = torch.tensor(query_lens, dtype=torch.int64).cumsum(0) - 1
            decode_rows = torch.arange(len(decodes)) + sum(query_lens)
            hidden = hidden[torch.cat([ends, decode_rows])]
        with torch.no_grad():
            return self.model.compute_logits(hidden)
