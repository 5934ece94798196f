"""`Front`: the ASGI app on the public --host/--port of `serve --tensor-parallel N` (docs/scale-out.md "Recovery").

Every request goes to the current generation's rank 0 (`GroupState`), once its `/health` answered 200
(`watch` probes it). While none does, `/health` answers 503 saying why and which generation is
starting, and requests wait for one, up to `wait_s`, then get a retryable 503 in their API's shape.

A completion is resumable: it carries the launch's secret (`protocol.py`), which no client can send
(the header is stripped from theirs). A streamed one goes through a `Splice`; when rank 0 is lost
under it (the connection cut, or `: lost`), the client's connection stays open, the request goes
again to the next generation with what the client already has, and the splice carries on from there:
the client sees one response (logprobs included: the replayed tokens' were delivered already, and the
new ones come from the next generation). A non-streamed one is simply sent again (nothing was
delivered). Every other request is passed through once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from mlx_trio.front.group_state import Generation, GroupState
from mlx_trio.front.protocol import LINK_HEADER, LOST_HEADER, RESUME_KEY, SECRET_HEADER
from mlx_trio.front.splice import Splice
from mlx_trio.front.upstream import Answer, Cut, Headers, exchange
from mlx_trio.http.server.errors import ANTHROPIC_PATHS, ApiError

log = logging.getLogger("mlx_trio.front")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# How long a request waits for a generation that serves (the relaunch of a small model takes 8-25 s).
WAIT_S = 120.0
COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions", "/v1/messages",
                              "/v1/responses", "/responses"})
_PROBE_S = 0.25  # while no rank 0 serves
_RECHECK_S = 1.0  # while one does
_POLL_S = 0.05
# Per hop (RFC 9110 7.6.1), or the front's own to set: never copied from one side to the other.
_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host", b"upgrade",
                  b"te", b"trailer", b"proxy-connection"})
_TO_RANK0_DROPPED = _HOP | {SECRET_HEADER.encode()}
_TO_CLIENT_DROPPED = _HOP | {b"date", b"server", LINK_HEADER.encode(), LOST_HEADER.encode()}


class Front:
    """The app; `watch` must run beside it (it finds the rank 0 that serves). `on_serving(generation)` is
    called each time a generation's rank 0 first answers /health."""

    def __init__(self, group: GroupState, secret: str, *, wait_s: float = WAIT_S,
                 on_serving: Callable[[Generation], None] = lambda _: None) -> None:
        self._group = group
        self._secret = secret.encode()
        self._wait_s = wait_s
        self._on_serving = on_serving
        # The generation whose rank 0 answered /health 200 last, None while none does.
        self.serving: Generation | None = None
        self._announced = 0

    # -- which rank 0 serves ----------------------------------------------------------------------------

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            now = self._group.now()
            self.serving = now if now.port is not None and await _healthy(now.port) else None
            if self.serving is not None and now.number > self._announced:
                self._announced = now.number
                self._on_serving(now)
            await trio.sleep(_RECHECK_S if self.serving is not None else _PROBE_S)

    async def _ready(self, deadline: float) -> Generation | None:
        """The generation to send to, once one serves; None past `deadline`."""
        with trio.move_on_at(deadline):
            while True:
                serving = self.serving
                if serving is not None and serving == self._group.now():
                    return serving
                await trio.sleep(_POLL_S)
        return None

    def _failed(self, generation: Generation) -> None:
        """A request to `generation` was cut or refused: send nothing more there until /health says so."""
        if self.serving == generation:
            self.serving = None

    # -- ASGI -------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await _body(receive)
        if body is None:
            return
        with trio.CancelScope() as cancel:
            async with trio.open_nursery() as nursery:
                # The client went away: stop, and so close the connection to rank 0 (which frees the request).
                nursery.start_soon(_cancel_on_disconnect, receive, cancel)
                if scope["path"] == "/health" and scope["method"] == "GET":
                    await self._health(send)
                elif scope["path"] in COMPLETION_PATHS and scope["method"] == "POST":
                    await self._completion(scope, body, send)
                else:
                    await self._once(scope, body, send)
                nursery.cancel_scope.cancel()

    async def _health(self, send: Send) -> None:
        serving = self.serving
        if serving is not None and serving == self._group.now() and serving.port is not None:
            try:
                async with exchange(serving.port, b"GET", b"/health", [], b"") as answer:
                    await _answer(send, answer.status, answer.headers, await answer.read())
                return
            except Cut:
                pass
        now = self._group.now()
        reason = f"{now.reason} (generation {now.number})"
        await _json(send, 503, {"status": "unavailable", "reason": reason, "generation": now.number})

    async def _once(self, scope: Scope, body: bytes, send: Send) -> None:
        """Any other request: to the rank 0 that serves (waiting for one), passed through once."""
        generation = await self._ready(trio.current_time() + self._wait_s)
        if generation is None:
            await self._unavailable(scope, send)
            return
        try:
            async with exchange(_port(generation), scope["method"].encode(), _target(scope),
                                self._headers(scope), body) as answer:
                await _through(send, answer)
        except Cut:
            self._failed(generation)
            await self._unavailable(scope, send)

    async def _completion(self, scope: Scope, body: bytes, send: Send) -> None:
        """A completion, to the end whatever generations it takes (`wait_s` at most for each)."""
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            await self._once(scope, body, send)  # rank 0 answers the 400
            return
        if doc.pop(RESUME_KEY, None) is not None:  # the front's alone to send, as its secret is
            body = json.dumps(doc, ensure_ascii=False).encode()
        streamed = doc.get("stream") is True
        splice, link, started = Splice(), None, False
        while True:
            generation = await self._ready(trio.current_time() + self._wait_s)
            if generation is None:
                await (self._cut_short(scope, send) if started else self._unavailable(scope, send))
                return
            payload = body if link is None else _resumed(doc, link, splice)
            try:
                async with exchange(_port(generation), b"POST", _target(scope), self._headers(scope),
                                    payload) as answer:
                    if answer.status == 503 and answer.header(LOST_HEADER.encode()):
                        raise Cut("rank 0 lost its group before it answered")
                    linked = answer.header(LINK_HEADER.encode())
                    if not (streamed and answer.status == 200 and linked):
                        if started:  # a resumed attempt that rank 0 would not take: nothing to splice
                            await self._cut_short(scope, send)
                        elif streamed:
                            await _through(send, answer)
                        else:  # read whole first: a cut answer is sent again
                            await _answer(send, answer.status, answer.headers, await answer.read())
                        return
                    if not started:
                        await send({"type": "http.response.start", "status": 200,
                                    "headers": _to_client(answer.headers)})
                        started, link = True, linked.decode()
                    await _spliced(answer, splice, send)
                    return
            except Cut as exc:
                log.warning("%s %s: %s; resuming after %d tokens on the next generation", scope["method"],
                         scope["path"], exc, splice.delivered)
            self._failed(generation)

    def _headers(self, scope: Scope) -> Headers:
        return [*((k, v) for k, v in scope["headers"] if k.lower() not in _TO_RANK0_DROPPED),
                (SECRET_HEADER.encode(), self._secret)]

    async def _unavailable(self, scope: Scope, send: Send) -> None:
        error = self._error()
        body = error.anthropic_body() if scope["path"] in ANTHROPIC_PATHS else error.body()
        await _json(send, error.status, body, headers=[(b"retry-after", b"1")])

    async def _cut_short(self, scope: Scope, send: Send) -> None:
        """A started stream no generation came to finish: its in-band error where the API has one, then the end."""
        error = self._error()
        path = scope["path"]
        if path in ANTHROPIC_PATHS:
            frames = b"event: error\ndata: " + json.dumps(error.anthropic_body()).encode() + b"\n\n"
        elif path in ("/v1/responses", "/responses"):
            frames = b""  # its error event needs the stream's sequence number, which only rank 0 knew
        else:
            frames = b"data: " + json.dumps(error.body()).encode() + b"\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": frames, "more_body": False})

    def _error(self) -> ApiError:
        now = self._group.now()
        return ApiError(503, f"the scale-out group did not come back within {self._wait_s:g} s: {now.reason} "
                             f"(generation {now.number})", "engine_unavailable", "group_relaunching")


async def _spliced(answer: Answer, splice: Splice, send: Send) -> None:
    """One attempt's body through `splice` to the client, to the answer's end. Raises `Cut` when the
    connection was cut, or rank 0 said it lost its group."""
    splice.restart()
    async for data in answer.body():
        out = splice.feed(data)
        if out:
            await send({"type": "http.response.body", "body": out, "more_body": True})
        if splice.lost:
            raise Cut("rank 0 lost its group mid-answer")
    await send({"type": "http.response.body", "body": splice.end(), "more_body": False})


def _resumed(doc: dict[str, Any], link: str, splice: Splice) -> bytes:
    """The request again, with what its client already has (`protocol.RESUME_KEY`)."""
    response_id, _, created = link.partition(" ")
    resume = {"id": response_id, "created": int(created), "opened": splice.opened, "groups": splice.groups}
    return json.dumps({**doc, RESUME_KEY: resume}, ensure_ascii=False).encode()


async def _healthy(port: int) -> bool:
    try:
        with trio.move_on_after(10):
            async with exchange(port, b"GET", b"/health", [], b"") as answer:
                await answer.read()
                return answer.status == 200
    except Cut:
        pass
    return False


def _port(generation: Generation) -> int:
    assert generation.port is not None  # `_ready` returns only generations that serve
    return generation.port


def _target(scope: Scope) -> bytes:
    raw = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return raw + (b"?" + query if query else b"")


def _to_client(headers: Headers) -> Headers:
    return [(k, v) for k, v in headers if k.lower() not in _TO_CLIENT_DROPPED]


async def _through(send: Send, answer: Answer) -> None:
    """Pass `answer` through as it comes. Cut after its head, it ends there: the client's answer is short
    of its end (no `[DONE]`, no closing event), which is all a proxy can say once the status is out."""
    await send({"type": "http.response.start", "status": answer.status, "headers": _to_client(answer.headers)})
    try:
        async for data in answer.body():
            await send({"type": "http.response.body", "body": data, "more_body": True})
    except Cut as exc:
        log.warning("an answer passed through was cut: %s", exc)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _answer(send: Send, status: int, headers: Headers, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_to_client(headers), (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _json(send: Send, status: int, payload: Any, *, headers: Headers | None = None) -> None:
    await _answer(send, status, [(b"content-type", b"application/json"), *(headers or [])],
                  json.dumps(payload).encode())


async def _body(receive: Receive) -> bytes | None:
    """The request's whole body; None when the client left before it ended."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
