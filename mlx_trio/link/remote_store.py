"""`RemoteResponses`: a front process's `/v1/responses` store, the one `ResponseStore` of the engine's process.

Every front of `--api-server-count N` reads and writes the store the
`LinkServer` owns (link_server.py: `store_get`, `store_put`,
`store_delete`), so a `previous_response_id` made through one front is
found through any other, and a front that restarts loses none of it. A put
returns once the engine's process has answered, that is once the entry is
in its store: the endpoint sends a response's end only after it, so a
client's next turn through another front finds it.

While the link is down each call fails as every link call does (`EngineDown`,
a retryable 503).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from mlx_trio.http.responses.store import StoredResponse

# `RemoteEngine._call`: one op over the link and its answer (an `err` raised).
Call = Callable[[str, Any], Awaitable[Any]]


class RemoteResponses:
    """`Responses` (http/responses/store.py) over the engine link."""

    def __init__(self, call: Call) -> None:
        self._call = call

    async def get(self, response_id: str) -> StoredResponse | None:
        found: StoredResponse | None = await self._call("store_get", response_id)
        return found

    async def put(self, entry: StoredResponse) -> bool:
        return bool(await self._call("store_put", entry))

    async def delete(self, response_id: str) -> bool:
        return bool(await self._call("store_delete", response_id))
