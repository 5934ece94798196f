"""The front (mlx_trio/front/proxy.py) before scripted rank 0s on loopback (raw HTTP, no model, no ranks):
a stream cut mid-chunk resumes on the next generation as one response, `: lost` too, a non-streamed answer
is sent again, /health says why nothing serves, waiting is bounded, and a client's internal header is
replaced by the launch's secret (its resume key dropped)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from mlx_trio.front.group_state import GroupState
from mlx_trio.front.protocol import LINK_HEADER, LOST, LOST_HEADER, RESUME_KEY, SECRET_HEADER, commit
from mlx_trio.front.proxy import Front

SECRET = "s3cret"
OPENING = b'data: {"role": "assistant"}\n\n'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@attrs.define
class ScriptedRank0:
    """A rank 0 on a loopback port: /health answers `healthy`; a completion gets `answer(request)`'s parts
    (bytes written as they come; None: the connection is cut there)."""

    answer: Callable[[dict[str, Any]], list[bytes | None]]
    healthy: bool = True
    requests: list[tuple[dict[bytes, bytes], dict[str, Any]]] = attrs.field(factory=list)
    port: int = 0

    async def serve(self, nursery: trio.Nursery) -> None:
        listeners = await nursery.start(trio.serve_tcp, self._handle, 0)
        self.port = listeners[0].socket.getsockname()[1]

    async def _handle(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
        while len(body) < int(headers.get(b"content-length", b"0")):
            body += await stream.receive_some(65536)
        if lines[0].startswith(b"GET /health"):
            status = b"200 OK" if self.healthy else b"503 Service Unavailable"
            await stream.send_all(b"HTTP/1.1 " + status + b"\r\ncontent-length: 2\r\n\r\n{}")
            return
        request = json.loads(body)
        self.requests.append((headers, request))
        parts = self.answer(request)
        for part in parts:
            if part is None:
                self.healthy = False  # as a rank 0 that lost its group
                return  # the connection is cut
            await stream.send_all(part)


def _sse(link: str, *chunks: bytes | None) -> list[bytes | None]:
    """A linked SSE answer, one HTTP chunk per item; a None item cuts the connection there."""
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" + LINK_HEADER.encode() + b": "
            + link.encode() + b"\r\ntransfer-encoding: chunked\r\n\r\n")
    return [head, *(None if c is None else _chunk(c) for c in chunks), b"0\r\n\r\n"]


async def _call(front: Front, path: str, body: dict[str, Any], *, method: str = "POST",
                headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request through the front's ASGI app: (status, headers, body)."""
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json"), *(headers or [])]}
    await front(scope, receive, send)
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


async def _with_front(test: Callable[[Front, GroupState, trio.Nursery], Awaitable[None]], **options: Any) -> None:
    group = GroupState()
    front = Front(group, SECRET, **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(front.watch)
        with trio.fail_after(30):
            await test(front, group, nursery)
        nursery.cancel_scope.cancel()


async def test_a_stream_cut_mid_chunk_is_resumed_on_the_next_generation_as_one_response() -> None:
    first = ScriptedRank0(lambda _: _sse("chatcmpl-1 123", OPENING + commit(()), b"data: a\n\n" + commit((1, 2)),
                                         b"data: b\n\n"[:5], None))  # cut inside the third chunk
    second = ScriptedRank0(lambda _: _sse("chatcmpl-1 123", b"data: b\n\n" + commit((3,)), b"data: [DONE]\n\n"))

    async def test(front: Front, group: GroupState, nursery: trio.Nursery) -> None:
        await first.serve(nursery)
        await second.serve(nursery)
        group.launched(1, first.port, "starting")
        answer: list[tuple[int, dict[bytes, bytes], bytes]] = []

        async def client() -> None:
            answer.append(await _call(front, "/v1/chat/completions", {"stream": True, RESUME_KEY: {"id": "x"}},
                                      headers=[(SECRET_HEADER.encode(), b"a client's guess")]))

        nursery.start_soon(client)
        while first.healthy:  # until the cut
            await trio.sleep(0.01)
        group.lost("the scale-out group was lost: rank 1 exited (killed by signal 9)")
        status, _, body = await _call(front, "/health", {}, method="GET")
        assert status == 503 and json.loads(body) == {
            "status": "unavailable", "generation": 1,
            "reason": "the scale-out group was lost: rank 1 exited (killed by signal 9) (generation 1)"}
        group.launched(2, second.port, "the scale-out group is being relaunched: rank 1 exited")
        while not answer:
            await trio.sleep(0.01)
        status, headers, body = answer[0]
        assert status == 200 and LINK_HEADER.encode() not in headers
        assert body == OPENING + b"data: a\n\ndata: b\n\ndata: [DONE]\n\n"  # one response, no comment of ours
        (seen, sent), (_, resumed) = first.requests[0], second.requests[0]
        assert seen[SECRET_HEADER.encode()] == SECRET.encode()  # the client's guess replaced
        assert sent == {"stream": True}  # and its resume key dropped
        assert resumed[RESUME_KEY] == {"id": "chatcmpl-1", "created": 123, "opened": True, "groups": [[1, 2]]}

    await _with_front(test)


async def _across_a_relaunch(first: ScriptedRank0, second: ScriptedRank0, path: str,
                             body: dict[str, Any]) -> tuple[int, dict[bytes, bytes], bytes]:
    """`body` to `path` through a front whose generation 1 (`first`) is lost once it got the request, and
    relaunched as generation 2 (`second`)."""
    answers = []

    async def test(front: Front, group: GroupState, nursery: trio.Nursery) -> None:
        await first.serve(nursery)
        await second.serve(nursery)
        group.launched(1, first.port, "starting")

        async def relaunch() -> None:
            while not first.requests:
                await trio.sleep(0.01)
            first.healthy = False
            group.launched(2, second.port, "relaunched")

        nursery.start_soon(relaunch)
        answers.append(await _call(front, path, body))

    await _with_front(test)
    return answers[0]


async def test_a_stream_that_rank_0_ends_with_lost_is_resumed_too() -> None:
    first = ScriptedRank0(lambda _: _sse("msg_1 9", OPENING + commit(()), b"data: a\n\n" + commit((4,)),
                                         b"data: b\n\n" + LOST + b"event: error\ndata: {}\n\n"))
    second = ScriptedRank0(lambda _: _sse("msg_1 9", b"data: B\n\n" + commit((5,)), b"event: message_stop\n\n"))
    status, _, body = await _across_a_relaunch(first, second, "/v1/messages", {"stream": True})
    assert status == 200 and body == OPENING + b"data: a\n\ndata: B\n\nevent: message_stop\n\n"
    assert second.requests[0][1][RESUME_KEY]["groups"] == [[4]]


async def test_a_non_streamed_request_that_met_a_lost_group_is_sent_again_whole() -> None:
    lost = [b"HTTP/1.1 503 Service Unavailable\r\n" + LOST_HEADER.encode() + b": 1\r\ncontent-length: 0\r\n\r\n"]
    first = ScriptedRank0(lambda _: lost)
    whole = b'{"choices": []}'
    second = ScriptedRank0(lambda _: [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
                                      b"\r\n\r\n%s" % (len(whole), whole)])
    status, _, body = await _across_a_relaunch(first, second, "/v1/completions", {"prompt": "x"})
    assert (status, body) == (200, whole)
    assert RESUME_KEY not in second.requests[0][1]  # nothing was delivered: the request as the client sent it


async def test_with_no_rank_0_serving_requests_wait_a_bounded_time_then_get_a_retryable_503_in_their_shape() -> None:
    async def test(front: Front, group: GroupState, nursery: trio.Nursery) -> None:
        status, headers, body = await _call(front, "/v1/messages", {"stream": True})
        assert status == 503 and headers[b"retry-after"] == b"1"
        assert json.loads(body)["type"] == "error" and json.loads(body)["error"]["type"] == "api_error"
        status, _, body = await _call(front, "/v1/chat/completions", {})
        assert status == 503 and json.loads(body)["error"]["code"] == "group_relaunching"
        assert "starting: the ranks are being launched (generation 0)" in json.loads(body)["error"]["message"]

    await _with_front(test, wait_s=0.3)
