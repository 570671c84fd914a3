"""The Responses API's memory: stored responses, for `previous_response_id` and GET /v1/responses/{id}.

Bounded both ways: at most `max_entries` responses over all tenants (the least recently stored go first) and
none older than `ttl` seconds. Keyed by (tenant, response id): a tenant reading another tenant's id finds
nothing, exactly as for an id that never existed (404 either way, so ids cannot be probed across keys).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    body: dict
    """The response object as it was answered."""
    conversation: list[dict]
    """The chat messages a follow-up continues from: the input's (without instructions), then the output's."""
    stored_at: float


class ResponseStore:
    def __init__(self, max_entries: int, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def put(self, tenant_id: str, response_id: str, body: dict, conversation: list[dict]) -> None:
        if self.max_entries <= 0:
            return
        self._expire()
        key = (tenant_id, response_id)
        self._entries[key] = StoredResponse(body, conversation, self._clock())
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, tenant_id: str, response_id: str) -> StoredResponse | None:
        """The tenant's stored response, or None (absent, expired, or another tenant's)."""
        self._expire()
        return self._entries.get((tenant_id, response_id))

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        """Drop what is older than the ttl (stored in time order, so from the front)."""
        oldest_kept = self._clock() - self.ttl
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.stored_at >= oldest_kept:
                return
            del self._entries[key]
