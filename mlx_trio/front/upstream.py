"""One HTTP/1.1 exchange with rank 0 on a loopback port: h11 over a Trio TCP stream (no client library).

hypercorn already brings h11, and the front needs nothing an HTTP client library adds: one request,
one response, its body as it arrives, and a clear difference between a body that ended (the
answer is whole) and a connection that was cut before the end (`Cut`: rank 0 died).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import h11
import trio

Headers = list[tuple[bytes, bytes]]
_READ = 65536


class Cut(Exception):
    """Rank 0 could not be reached, or the connection ended before the whole answer."""


@attrs.define
class Answer:
    """A response's status and headers; `body()` yields its data until the end (`Cut` if it never comes)."""

    status: int
    headers: Headers
    _connection: h11.Connection
    _stream: trio.SocketStream

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key.lower() == name), None)

    async def body(self) -> AsyncIterator[bytes]:
        while True:
            event = await _next_event(self._connection, self._stream)
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.body()])


@asynccontextmanager
async def exchange(port: int, method: bytes, target: bytes, headers: Sequence[tuple[bytes, bytes]],
                   body: bytes) -> AsyncIterator[Answer]:
    """Send one request to 127.0.0.1:`port`; the answer once its head arrived. Raises `Cut`."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError as exc:
        raise Cut(f"rank 0 is not reachable: {exc}") from exc
    async with stream:
        connection = h11.Connection(h11.CLIENT)
        head = h11.Request(method=method, target=target, headers=[
            (b"host", b"127.0.0.1:%d" % port), *headers, (b"content-length", b"%d" % len(body))])
        try:
            await stream.send_all(connection.send(head) + connection.send(h11.Data(data=body))
                                  + connection.send(h11.EndOfMessage()))
        except (trio.BrokenResourceError, OSError) as exc:
            raise Cut(f"rank 0 went away: {exc}") from exc
        response = await _next_event(connection, stream)
        assert isinstance(response, h11.Response)
        yield Answer(response.status_code, [(k, v) for k, v in response.headers], connection, stream)


async def _next_event(connection: h11.Connection, stream: trio.SocketStream) -> h11.Event:
    while True:
        try:
            event = connection.next_event()
        except h11.RemoteProtocolError as exc:  # e.g. closed before the end of a chunked body
            raise Cut(f"rank 0's answer was cut: {exc}") from exc
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(_READ)
            except (trio.BrokenResourceError, OSError) as exc:
                raise Cut(f"rank 0's answer was cut: {exc}") from exc
            connection.receive_data(data)
        elif isinstance(event, h11.ConnectionClosed):
            raise Cut("rank 0 closed the connection before its answer ended")
        elif isinstance(event, h11.InformationalResponse):
            continue
        else:
            return event
