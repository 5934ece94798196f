"""A client that stops reading its stream: the write timeout ends the stream and frees its request."""

from __future__ import annotations

import json
import socket

import trio
from tests.http.fakes import FakeEngine
from tests.http.http_helpers import serve_fake

# A hang is the failure; a normal run ends within a few seconds.
HANG_GUARD_S = 60


async def _open_and_never_read(port: int, body: dict) -> trio.SocketStream:
    """A raw connection with a tiny receive buffer that sends one streamed request and then reads nothing."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    payload = json.dumps(body).encode()
    await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return stream


async def test_a_client_that_never_reads_loses_its_stream_after_the_write_timeout() -> None:
    """The blocked write is given up: the engine stream closes (row and session freed), the slot too."""
    engine = FakeEngine(context_length=10**7)
    body = {"prompt": "hi", "max_tokens": 10**7 - 10, "stream": True}
    async with serve_fake(engine, write_timeout_s=0.5) as (server, http):
        with trio.fail_after(HANG_GUARD_S):
            stream = await _open_and_never_read(server.port, body)
            while engine.active == 0:
                await trio.sleep(0.01)
            while engine.closed_streams == 0:  # the socket buffers fill, a write blocks, the timeout ends it
                await trio.sleep(0.05)
            assert engine.active == 0
            while server.drain_state.in_flight:
                await trio.sleep(0.01)
            # The server still serves others.
            response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert response.status_code == 200
        await stream.aclose()
