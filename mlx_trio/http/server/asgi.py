"""ASGI wrappers: count requests in flight (for the drain), bound the reading of a request body
and read it to its end after an early response, and end a response whose client stopped reading.

Why `DrainRequestBody`: hypercorn (0.18, Trio worker) feeds body chunks to the app through a
bounded queue (`max_app_queue_size`, 10 messages). quart-trio stops reading
it as soon as the response is sent. When we answer before the body is in (413
for a body over the limit, 401 before reading it), the client keeps sending,
the queue fills, and hypercorn blocks forever on the connection: the client
sees its answer but the next request on that keep-alive connection hangs.
Reading (and dropping) the rest of the body here lets hypercorn finish the
request cycle normally. Any response sent before the body is in (an error, or
any other status a router may answer early) also gets `Connection: close`:
hypercorn closes a connection whose request was not read to the end, and a
client that was not told so would reuse it and wait forever.

Why a body deadline of its own (`--body-timeout`): quart's `BODY_TIMEOUT`
(60 s) bounds only the handler's wait, counted from when it asks, and after
the early answer a trickling client held the request (and so the drain) up
to another 30 s. Here one deadline, counted from the request's start, bounds
every wait for the body, before and after the answer, and the drain's cut
ends such a wait at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

from mlx_trio.http.server.config import DEFAULT_BODY_TIMEOUT_S
from mlx_trio.http.server.drain import Drain
from mlx_trio.http.server.errors import ANTHROPIC_PATHS, INVALID_REQUEST, ApiError, shutdown_cut

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]  # ASGI is duck-typed; quart's own types are narrower

log = logging.getLogger("mlx_trio.http")

class DrainRequestBody:
    """Wraps an ASGI app; bounds the wait for the request body, and consumes it to its end after the app.

    The body must be in within `timeout_s` of the request's start and before
    the drain's cut (`drain.cut`). Past either, the wrapper answers itself,
    when no response has started: 408 `request_timeout` (503 `shutdown` at
    the cut), in the API's error shape, with `Connection: close`; then it
    tells the app the client left (`http.disconnect`, which ends quart's
    handler) and drops whatever the app still sends. A body that is in is
    never timed: a response may stream for as long as it runs.
    """

    def __init__(self, app: ASGIApp, *, timeout_s: float = DEFAULT_BODY_TIMEOUT_S, drain: Drain | None = None) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.drain = drain if drain is not None else Drain()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = trio.current_time() + self.timeout_s
        finished = False  # the body is in, the client left, or we gave up on the body
        started = given_up = False

        async def tracked_receive() -> Message:
            nonlocal finished, given_up
            if finished:  # all that is left to wait for is the disconnect: untimed
                return await receive()
            with trio.CancelScope(deadline=deadline) as wait, self.drain.cutting(wait):
                message = await receive()
            if wait.cancelled_caught:
                finished = given_up = True
                if not started:
                    await send_error(shutdown_cut().error if self.drain.cut else self._timed_out())
                return {"type": "http.disconnect"}
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                finished = True
            return message

        async def closing_send(message: Message) -> None:
            nonlocal started
            if given_up:
                return
            if message["type"] == "http.response.start":
                started = True
                if not finished:
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        async def send_error(error: ApiError) -> None:
            body = json.dumps(error.anthropic_body() if scope.get("path", "").startswith(ANTHROPIC_PATHS)
                              else error.body()).encode()
            log.info("%s %s refused: %d %s", scope.get("method"), scope.get("path"), error.status, error.code)
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close"), *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
            await send({"type": "http.response.start", "status": error.status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, tracked_receive, closing_send)
        while not finished:
            await tracked_receive()

    def _timed_out(self) -> ApiError:
        return ApiError(408, f"the request body did not arrive within {self.timeout_s:g} s (--body-timeout)",
                        INVALID_REQUEST, "request_timeout")


class CountInFlight:
    """Wraps an ASGI app; holds `drain.track()` around each HTTP request's whole life.

    At this level a request is counted until its response body has been sent
    (or the client left), however the handler ended, which the app's own hooks
    cannot promise for streamed bodies.
    """

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with self.drain.track():
            await self.app(scope, receive, send)


class ClientNotReading(Exception):
    """A response write waited past the write timeout (or past the drain's cut); the connection is closed."""


class WriteTimeout:
    """Wraps an ASGI app; a response write that waits past `timeout_s` closes the connection.

    Why: hypercorn (0.18, Trio) writes to the socket under a shielded cancel
    scope, so a client that never reads blocks that write, and the handler
    awaiting it, for ever: cancellation (a drain, a SIGTERM) cannot reach
    it, and the request keeps its engine session and row after its
    generation ended. Closing the socket is what wakes such a write (Trio
    raises in the blocked `send_all`). The socket is found by following the
    `send` callable ASGI gives us back to hypercorn's connection
    (`HTTPStream.app_send` → `H11Protocol.stream_send` →
    `TCPServer.protocol_send`, whose `stream` it is); where the chain is not
    there (another server, HTTP/2) nothing is closed and the wrapper only
    passes messages through.

    A watchdog per request wakes every `timeout_s / 4` (at most
    `MAX_TICK_S`) while a write is pending: past `timeout_s`, or at once
    once `drain.cut` is set, it closes the socket; the pending write then
    returns and this wrapper raises `ClientNotReading` into the app, which
    ends the handler (its engine stream closes, freeing the request), and
    swallows it on the way out: the client is gone.
    """

    MAX_TICK_S = 0.5

    def __init__(self, app: ASGIApp, drain: Drain, *, timeout_s: float) -> None:
        self.app = app
        self.drain = drain
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = _transport(send) if scope["type"] == "http" else None
        if transport is None:
            await self.app(scope, receive, send)
            return
        pending_since: float | None = None
        closed = False

        async def timed_send(message: Message) -> None:
            nonlocal pending_since
            if closed:
                raise ClientNotReading("the connection was closed: the client stopped reading")
            pending_since = trio.current_time()
            try:
                await send(message)
            finally:
                pending_since = None
            if closed:
                raise ClientNotReading(f"a response write waited over {self.timeout_s:g} s for the client")

        async def watchdog() -> None:
            nonlocal closed
            tick = min(self.timeout_s / 4, self.MAX_TICK_S)
            while True:
                await trio.sleep(tick)
                since = pending_since
                if since is not None and (self.drain.cut or trio.current_time() - since > self.timeout_s):
                    log.warning("closing a connection whose client has not read for %.0f s",
                                trio.current_time() - since)
                    closed = True
                    await transport.aclose()
                    return

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watchdog)
                try:
                    await self.app(scope, receive, timed_send)
                finally:
                    nursery.cancel_scope.cancel()
        except* ClientNotReading:
            pass


def _transport(send: Send) -> trio.abc.AsyncResource | None:
    """The Trio stream under hypercorn's ASGI `send` (see `WriteTimeout`), or None."""
    hop: Any = send
    for _ in range(4):
        owner = getattr(hop, "__self__", None)
        stream = getattr(owner, "stream", None)
        if isinstance(stream, trio.abc.Stream):
            return stream
        hop = getattr(owner, "send", None)
    return None
