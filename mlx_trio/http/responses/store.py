"""Stored responses: what `previous_response_id`, `GET /v1/responses/{id}` and `input_items` read back.

`ResponseStore` is a bounded in-RAM map, least recently used first out,
sized by the JSON bytes of what it holds (`--responses-store-bytes`; 0
stores nothing). An entry larger than the whole budget is not kept.
Everything runs on the Trio loop, so no lock is needed.

The endpoint reads and writes through `Responses` (async): `LocalResponses`
is the app's own `ResponseStore`; the front processes of `--api-server-count`
share one kept in the engine's process instead (mlx_trio/link/remote_store.py),
so a `previous_response_id` made through one front is found through another.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import attrs

log = logging.getLogger("mlx_trio.http")


@attrs.frozen
class StoredResponse:
    """One finished response and what continuing from it needs.

    `input_items` are the items its request sent (ids added), for
    `input_items`; `context` is every item the next turn continues from:
    the chain's earlier context, this input, then this response's output.
    """

    response: Mapping[str, Any]
    input_items: tuple[Mapping[str, Any], ...]
    context: tuple[Mapping[str, Any], ...]

    @property
    def nbytes(self) -> int:
        return len(json.dumps([self.response, self.input_items, self.context], ensure_ascii=False).encode())


class ResponseStore:
    """Responses by id, at most `capacity_bytes` of them (by their JSON size); the least recently used go first."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Keep `entry` under its response id, evicting older ones to fit; False when it cannot fit at all."""
        size = entry.nbytes
        key = str(entry.response["id"])
        self.delete(key)
        if size > self.capacity_bytes:
            if self.capacity_bytes:
                log.info("response %s (%d bytes) is larger than --responses-store-bytes; not stored", key, size)
            return False
        while self.nbytes + size > self.capacity_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.nbytes -= evicted
        self._entries[key] = (entry, size)
        self.nbytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        found = self._entries.get(response_id)
        if found is None:
            return None
        self._entries.move_to_end(response_id)
        return found[0]

    def delete(self, response_id: str) -> bool:
        found = self._entries.pop(response_id, None)
        if found is None:
            return False
        self.nbytes -= found[1]
        return True



class Responses(Protocol):
    """Where the endpoint keeps finished responses. `put` returns only once the entry can be read back
    by any later `get` of the same store (the endpoint sends a response's end after it)."""

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, entry: StoredResponse) -> bool: ...

    async def delete(self, response_id: str) -> bool: ...


class LocalResponses:
    """`Responses` over a `ResponseStore` of this process (the in-process server's, one per app)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    async def put(self, entry: StoredResponse) -> bool:
        return self.store.put(entry)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)
