"""`LinkServer`: the engine process's end of the engine link, a child of the engine's root supervisor.

It listens on a Unix socket and serves each front process that connects
(mlx_trio/link/wire.py for the frames). What a front asks (op, id, payload):

    generate (prompt, kwargs)      -> ok Request, then as `stream`    (`Engine.prepare_off_loop`, then its
                                      `Engine.stream`: the request crosses the socket once) | err MlxTrioError
    count    (prompt, kwargs)      -> ok int | err                    (`Engine.count_tokens`, a worker thread)
    status   None                  -> ok dict                         (`Engine.status`, its faults)
    load     (name, path)          -> ok None | err                   (`Engine.load_adapter`)
    unload   name                  -> ok None | err                   (`Engine.unload_adapter`)
    arm      (actor, kind)         -> ok ArmedFault | err             (`Engine.faults.arm`)
    stream   (Request, replay)     -> event GenerationEvent* then end None | err MlxTrioError | lost reason
    cancel   None                  (the stream of that id: its client left before its Finished)
    store_get     response id      -> ok StoredResponse | None        (the /v1/responses store, below)
    store_put     StoredResponse   -> ok bool                         (answered once it is stored)
    store_delete  response id      -> ok bool

and what it pushes unasked: `facts` (id 0), the values the HTTP layer reads
synchronously (health, model id, context length, output format, adapters,
the scale-out group's loss), at connect and whenever they change. The output
format travels pickled on its own (bytes): unpickling it imports mlx-lm, which
a front does at its first read and the launcher's link never does.

A stream that fails once rank 0 lost its scale-out group ends with `lost`, not
its error: the launcher is about to start the group again, and the front
resumes the stream there, as after the death of the engine's process.

Each stream is one `Engine.stream` in a task of its own, so the resume loop,
sessions and their guarantees stay exactly those of the in-process server; a
front that goes away cancels its streams (their rows leave the batch and free
their KV, as a client's disconnect does). An error of one call or stream goes
back to it alone; nothing a front sends can stop the link for another front.

The server owns the one `/v1/responses` store of every front (a
`ResponseStore` of `responses_store_bytes`; mlx_trio/link/remote_store.py the
front's side): a response stored through one front is found through another.
It lives as long as this object, across restarts of the link child.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from mlx_trio.api import Engine
from mlx_trio.errors import EngineFailure, MlxTrioError
from mlx_trio.http.responses.store import ResponseStore
from mlx_trio.http.server.config import DEFAULT_RESPONSES_STORE_BYTES
from mlx_trio.profiling import request_phase
from mlx_trio.link.wire import FrameReader, LinkClosed, Outbox, until_closed
from mlx_trio.supervision import ChildSpec

log = logging.getLogger("mlx_trio.link")

LINK_ACTOR_ID = "link"
# How often the facts are compared with what the fronts were told last.
FACTS_EVERY_S = 0.05


class LinkServer:
    """Serves `engine` to the front processes on the Unix socket at `path` (created 0600), and their
    shared `/v1/responses` store of `responses_store_bytes` (`ServerConfig.responses_store_bytes`)."""

    def __init__(self, engine: Engine | None, path: str, *,
                 responses_store_bytes: int = DEFAULT_RESPONSES_STORE_BYTES) -> None:
        self._engine = engine
        self.path = path
        self.responses = ResponseStore(responses_store_bytes)
        self.fronts = 0  # connected now
        self.streams = 0  # running now, every front together

    def attach(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("no engine attached")
        return self._engine

    @property
    def child_spec(self) -> ChildSpec:
        return ChildSpec(id=LINK_ACTOR_ID, start=self.run, kind="link")

    def statistics(self) -> dict[str, object]:
        return {"fronts": self.fronts, "streams": self.streams}

    async def run(self, *, task_status: trio.TaskStatus[LinkServer] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, report `started(self)`, serve fronts until cancelled."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # ours from a crashed incarnation: the directory is private
        await sock.bind(self.path)
        os.chmod(self.path, 0o600)
        ours = os.stat(self.path).st_ino
        sock.listen(64)
        listener = trio.SocketListener(sock)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._serve_front, [listener])
                task_status.started(self)
        finally:
            with trio.CancelScope(shield=True):
                await listener.aclose()
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == ours:  # not a later incarnation's socket
                    os.unlink(self.path)

    async def _serve_front(self, stream: trio.SocketStream) -> None:
        self.fronts += 1
        try:
            await _FrontSession(self, stream).run()
        except LinkClosed as exc:
            log.info("a front process left the link: %s", exc)
        finally:
            self.fronts -= 1
            await stream.aclose()


class _FrontSession:
    """One connected front: its calls and streams, cancelled together when it leaves."""

    def __init__(self, server: LinkServer, stream: trio.SocketStream) -> None:
        self._server = server
        self._engine = server.engine
        self._stream = stream
        self._outbox = Outbox()
        self._streams: dict[int, trio.CancelScope] = {}

    async def run(self) -> None:
        """Serve this front until it leaves; raises that `LinkClosed`. Its streams end with it."""
        reader = FrameReader(self._stream)

        async def read() -> None:
            while True:
                for op, mid, payload in await reader.receive():
                    self._dispatch(op, mid, payload)

        async with trio.open_nursery() as nursery:
            self._nursery = nursery  # the calls and streams: cancelled when the front leaves (KV freed)
            closed = await until_closed(partial(self._outbox.run, self._stream), read, self._push_facts)
            nursery.cancel_scope.cancel()
        raise closed

    def _dispatch(self, op: str, mid: int, payload: Any) -> None:
        engine = self._engine
        if op == "generate":
            scope = self._streams[mid] = trio.CancelScope()
            self._nursery.start_soon(self._run_stream, mid, scope, None, (), payload)
        elif op == "stream":
            request, replay = payload
            scope = self._streams[mid] = trio.CancelScope()
            self._nursery.start_soon(self._run_stream, mid, scope, request, replay)
        elif op == "cancel":
            scope = self._streams.get(mid)
            if scope is not None:
                scope.cancel()
        elif op == "count":
            prompt, kwargs = payload
            self._call(mid, partial(_when_ready, engine, partial(trio.to_thread.run_sync,
                                                                 partial(engine.count_tokens, prompt, **kwargs))))
        elif op == "status":
            self._call(mid, _now(partial(_status, engine)))
        elif op == "load":
            self._call(mid, partial(engine.load_adapter, *payload))
        elif op == "unload":
            self._call(mid, partial(engine.unload_adapter, payload))
        elif op == "arm":
            self._call(mid, _now(partial(engine.faults.arm, *payload)))
        elif op == "store_get":
            self._call(mid, _now(partial(self._server.responses.get, payload)))
        elif op == "store_put":
            self._call(mid, _now(partial(self._server.responses.put, payload)))
        elif op == "store_delete":
            self._call(mid, _now(partial(self._server.responses.delete, payload)))
        else:
            self._call(mid, _now(partial(_unknown, op)))

    def _call(self, mid: int, fn: Callable[[], Awaitable[Any]]) -> None:
        async def call() -> None:
            try:
                result = await fn()
            except (MlxTrioError, ValueError) as exc:
                await self._outbox.put(("err", mid, _portable(exc)))
            except Exception as exc:  # noqa: BLE001  (a bug fails its call alone, as in-process)
                log.exception("link call %d failed", mid)
                await self._outbox.put(("err", mid, _portable(exc)))
            else:
                await self._outbox.put(("ok", mid, result))

        self._nursery.start_soon(call)

    async def _run_stream(self, mid: int, scope: trio.CancelScope, request: Any, replay: Any,
                          prepare: tuple[Any, dict[str, Any]] | None = None) -> None:
        """`Engine.stream` of `request`, or of what `prepare` (prompt, kwargs) prepares (answered first)."""
        server = self._server
        server.streams += 1
        try:
            with scope:
                try:
                    if prepare is not None:
                        request = await _prepare(self._engine, *prepare)
                        await self._outbox.put(("ok", mid, request))
                    await _wait_ready(self._engine)
                    # `replay` only when there is one, as the HTTP layer calls it (engines without it serve on).
                    events = self._engine.stream(request, replay=replay) if replay else self._engine.stream(request)
                    try:
                        async for event in events:
                            await self._outbox.put(("event", mid, event))
                    finally:
                        await events.aclose()
                except Exception as exc:  # noqa: BLE001  (the request's own failure, its stream alone)
                    lost = getattr(self._engine, "group_lost", None)
                    if lost is not None and request is not None:  # the front resumes it on the next group
                        await self._outbox.put(("lost", mid, lost))
                        return
                    if not isinstance(exc, MlxTrioError):
                        log.exception("stream %d failed", mid)
                    await self._outbox.put(("err", mid, _portable(exc)))
                else:
                    await self._outbox.put(("end", mid, None))
        finally:
            server.streams -= 1
            self._streams.pop(mid, None)

    async def _push_facts(self) -> None:
        told: dict[str, Any] | None = None
        while True:
            facts = engine_facts(self._engine)
            if facts != told:
                fmt = facts["output_format"]
                await self._outbox.put(("facts", 0, {**facts, "output_format": None if fmt is None else
                                                     pickle.dumps(fmt)}))
                told = facts
            await trio.sleep(FACTS_EVERY_S)


def engine_facts(engine: Engine) -> dict[str, Any]:
    """What the HTTP layer reads from the engine synchronously (`EngineLike`'s properties), as plain values."""
    try:
        model_id: str | None = engine.model_id
        context_length, output_format = engine.context_length, engine.output_format
    except MlxTrioError:  # still loading
        model_id, context_length, output_format = None, None, None
    return {"health": engine.health(), "group_lost": engine.group_lost, "model_id": model_id,
            "context_length": context_length, "output_format": output_format,
            "adapters": engine.served_adapters()}


async def _prepare(engine: Engine, prompt: Any, kwargs: dict[str, Any]) -> Any:
    """`Engine.prepare_off_loop`; under MLX_TRIO_PROFILE the request's timeline starts here, as it reached
    this process (the front's HTTP parsing before it is the front's, not the engine's)."""
    arrived = time.perf_counter()
    await _wait_ready(engine)
    request = await engine.prepare_off_loop(prompt, **kwargs)
    request_id = getattr(request, "request_id", None)
    if request_id is not None:
        request_phase(request_id, "arrived", arrived)
        request_phase(request_id, "prepared")
    return request


def _status(engine: Engine) -> dict[str, Any]:
    """`Engine.status`, and the engine's armed and fired faults (a front lists them with its own)."""
    faults = engine.faults
    return {**engine.status(), "faults": {"armed": faults.armed(), "fired": list(faults.fired)}}


async def _wait_ready(engine: Engine) -> None:
    """Until the model is loaded (a restarted engine's process links before that: its fronts' resumed streams
    and resent calls wait here, not fail); `ModelLoadError` if it never will be."""
    wait_ready = getattr(engine, "wait_ready", None)  # test fakes are always ready
    if wait_ready is not None:
        await wait_ready()


async def _when_ready(engine: Engine, fn: Callable[[], Awaitable[Any]]) -> Any:
    await _wait_ready(engine)
    return await fn()


def _now(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        return fn()

    return call


def _unknown(op: str) -> None:
    raise EngineFailure(f"the engine link has no operation {op!r} (front and engine of different versions?)")


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it crosses the link as itself; else an `EngineFailure` that says what it was."""
    if isinstance(exc, MlxTrioError):
        return exc
    if isinstance(exc, ValueError):  # e.g. Faults.arm's unknown kind: the caller maps it to a 400
        return ValueError(str(exc))
    return EngineFailure(f"{type(exc).__name__}: {exc}")
