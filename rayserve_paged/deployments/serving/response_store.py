"""The Responses API's conversation state: finished responses kept in memory for
`previous_response_id`, GET /v1/responses/{id} and its input items.

    put(id, entry)      newest;  drops least recently used entries past max_responses or
                        max_bytes, and entries idle longer than ttl_s
    get(id)             the entry, now the most recently used; None: unknown, deleted,
                        expired or evicted (the caller answers 404)

Bounded by what it costs (bytes) as well as by count: an entry holds its JSON as bytes
(the response body GET returns, and the conversation a continuation renders), so the
byte count is what the store really holds, and one entry larger than max_bytes is not
kept at all. One event loop reads and writes it: no lock.

The TTL counts from an entry's last use (put or get), so the least recently used entries
are also the ones that expire first: expiry pops from the LRU end, O(expired).
State lives in this process only; a replica restart loses it (docs/API.md says so).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, Field

logger = logging.getLogger(__name__)

ENTRY_OVERHEAD_BYTES = 256  # the entry object, its id and its place in the LRU


class ResponseStoreConfig(BaseModel):
    """Bounds of the per-replica Responses store (AppArgs.responses_store)."""

    max_responses: int = Field(4096, ge=0, description="Most responses kept; 0 keeps none (store is then a no-op).")
    max_bytes: int = Field(
        64 << 20, ge=0, description="Most bytes kept (response bodies and the conversations they continue)."
    )
    ttl_s: float = Field(
        3600.0, gt=0, allow_inf_nan=False, description="A response not read or continued for this long is dropped."
    )


@dataclass(slots=True)
class StoredResponse:
    response_json: bytes  # the body GET /v1/responses/{id} returns
    conversation_json: bytes  # the input items that produced it, earlier turns first (JSON list)
    num_input_items: int  # of those, the last this many are the request's own `input`
    conversation_id: str  # the first response of its chain: the routing session of continuations
    last_used: float = 0.0

    @property
    def num_bytes(self) -> int:
        return len(self.response_json) + len(self.conversation_json) + ENTRY_OVERHEAD_BYTES


class ResponseStore:
    def __init__(self, config: ResponseStoreConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or ResponseStoreConfig()
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self.num_bytes = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry` (False: larger than the whole store, not kept)."""
        self.delete(response_id)
        if entry.num_bytes > self.config.max_bytes or self.config.max_responses == 0:
            logger.warning("response %s (%d bytes) is larger than the store: not kept", response_id, entry.num_bytes)
            return False
        entry.last_used = now = self._clock()
        self._entries[response_id] = entry
        self.num_bytes += entry.num_bytes
        self._expire(now)
        while len(self._entries) > self.config.max_responses or self.num_bytes > self.config.max_bytes:
            self._drop_oldest()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        now = self._clock()
        self._expire(now)
        entry = self._entries.get(response_id)
        if entry is not None:
            entry.last_used = now
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True

    def _expire(self, now: float) -> None:
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.last_used <= self.config.ttl_s:
                return
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_bytes -= entry.num_bytes
        self.num_evicted += 1
