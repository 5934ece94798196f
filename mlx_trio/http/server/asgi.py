"""ASGI wrappers: count requests in flight (for the drain), and read a body to its end after an early response.

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
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

from mlx_trio.http.server.drain import Drain

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]  # ASGI is duck-typed; quart's own types are narrower

# Long enough for a client to finish uploading a body it already started; bounded so a
# client trickling an endless body cannot hold the task forever.
DRAIN_TIMEOUT_S = 30.0


class DrainRequestBody:
    """Wraps an ASGI app; after it returns, consumes the request body up to its end."""

    def __init__(self, app: ASGIApp, *, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        finished = False

        async def tracked_receive() -> Message:
            nonlocal finished
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                finished = True
            return message

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not finished:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, tracked_receive, closing_send)
        with trio.move_on_after(self.timeout_s):
            while not finished:
                await tracked_receive()


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
