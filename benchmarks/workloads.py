"""Synthetic requests the engine and serving benchmarks draw: prompt and output lengths
uniform on [min, max] (inclusive) and random token ids, the same for the same seed label."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Workload:
    num_requests: int
    min_prompt_len: int
    max_prompt_len: int
    min_output_len: int
    max_output_len: int


@dataclass(frozen=True, slots=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int


def uniform_requests(workload: Workload, label: str, first_token: int, token_limit: int) -> list[Request]:
    """`workload.num_requests` requests within its `min_/max_prompt_len` and
    `min_/max_output_len`; token ids in [first_token, token_limit); `label` seeds them."""
    rng = random.Random(label)
    requests = []
    for _ in range(workload.num_requests):
        prompt_len = rng.randint(workload.min_prompt_len, workload.max_prompt_len)
        output_len = rng.randint(workload.min_output_len, workload.max_output_len)
        prompt = [rng.randrange(first_token, token_limit) for _ in range(prompt_len)]
        requests.append(Request(prompt, output_len))
    return requests
