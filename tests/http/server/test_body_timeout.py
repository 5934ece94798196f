"""A client that sends its headers and then stalls or trickles the body: 408 within --body-timeout,
and the drain's cut ends such a request at once (issue #21 points 3 and 9)."""

from __future__ import annotations

import json

import trio
from tests.http.fakes import FakeEngine
from tests.http.http_helpers import serve_fake

# A hang is the failure; a normal run ends within a few seconds.
HANG_GUARD_S = 60
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()


async def _send_headers(port: int, path: str = "/v1/chat/completions") -> trio.SocketStream:
    """A raw connection that sent a request's headers and the first 10 bytes of its body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(BODY), BODY[:10]))
    return stream


async def _read_to_close(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


def _status_and_json(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


async def test_a_stalled_body_gets_a_408_in_openai_shape_and_the_connection_closes() -> None:
    """Headers and 10 bytes, then nothing: a 408 request_timeout naming the flag, Connection: close, closed;
    the server serves the next request and holds nothing in flight."""
    engine = FakeEngine()
    async with serve_fake(engine, body_timeout_s=0.5) as (server, client):
        with trio.fail_after(HANG_GUARD_S):
            stream = await _send_headers(server.port)
            status, headers, body = _status_and_json(await _read_to_close(stream))
            while server.drain_state.in_flight:
                await trio.sleep(0.01)
            response = await client.post("/v1/chat/completions", content=BODY,
                                         headers={"content-type": "application/json"})
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout" and body["error"]["type"] == "invalid_request_error"
    assert "--body-timeout" in body["error"]["message"]
    assert response.status_code == 200


async def test_a_trickled_body_is_timed_as_a_whole() -> None:
    """One byte every 50 ms never lets a per-read timer fire: the deadline counts from the request's start."""
    async with serve_fake(FakeEngine(), body_timeout_s=0.5) as (server, _):
        with trio.fail_after(HANG_GUARD_S):
            stream = await _send_headers(server.port, "/v1/messages")
            answer: list[bytes] = []
            async with trio.open_nursery() as nursery:
                async def read() -> None:
                    answer.append(await _read_to_close(stream))
                    nursery.cancel_scope.cancel()

                nursery.start_soon(read)
                for byte in BODY[10:-1]:  # never the last one
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(0.05)
    status, _, body = _status_and_json(answer[0])
    # /v1/messages answers in the Anthropic error shape.
    assert status == 408 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


async def test_the_drain_cuts_a_body_still_being_read_at_its_deadline() -> None:
    """A body stalled well within --body-timeout still ends at the drain's cut: a 503 shutdown, in flight 0."""
    async with serve_fake(FakeEngine(), body_timeout_s=600) as (server, _):
        with trio.fail_after(HANG_GUARD_S):
            stream = await _send_headers(server.port)
            while not server.drain_state.in_flight:
                await trio.sleep(0.01)
            report = await server.drain(0.2)
            status, headers, body = _status_and_json(await _read_to_close(stream))
            assert server.drain_state.in_flight == 0
    # Cut at the drain's deadline (HANG_GUARD_S is far inside the body's): no generation was cut.
    assert status == 503 and body["error"]["code"] == "shutdown" and headers["retry-after"] == "1"
    assert report.cut == 0
