"""`fresh_status`: the engine's status as of now, for the reads a client compares with what it was just answered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from mlx_trio.http.server.state import EngineLike

# How long a read of the engine's status waits for a fresh copy from another process (an engine process
# restarting: the link is down) before it answers with the last one.
FRESH_STATUS_WAIT_S = 2.0


async def fresh_status(engine: EngineLike) -> dict[str, Any]:
    """`engine.status()` as of now: read-your-writes for /stats, /v1/status and /metrics.

    An engine in this process answers from its actors; a front process's `RemoteEngine` holds a copy
    refreshed in the background, which may predate the response its client just read (its counters
    were seconds behind): it asks the engine's process first (`refresh_status`), within
    `FRESH_STATUS_WAIT_S`. The engine counts a request's work before its last event leaves (the
    decoder before it sends the tokens, prefill before token 0), so the answer includes every
    response its client already has.
    """
    refresh = getattr(engine, "refresh_status", None)
    if refresh is not None:
        with trio.move_on_after(FRESH_STATUS_WAIT_S):
            await refresh()
    return engine.status()
