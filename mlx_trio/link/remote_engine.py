"""`RemoteEngine`: a front process's engine, the `EngineLike` the HTTP app serves, over the engine link.

Every call and stream goes to the engine process (link_server.py says what
each op does there); what the HTTP layer reads synchronously (health, model
id, context length, output format, adapters) comes from the facts the
engine pushes, and `status()` from a copy refreshed in the background while
someone reads it (at most `STATUS_FRESH_S` old after the first read).

When the link breaks (the engine's process died, or a rank of its group did,
and the launcher starts it again), `run` connects again, health says why
meanwhile, and nothing in flight is lost: a stream waits for the new engine
(up to `RESUME_WAIT_S`; one that the engine ended with `lost`, its group gone,
waits for the next connection, not this one)
and goes on there from the tokens its caller already has (`Engine.stream`'s
`replay`, whose replayed chunks are not shown twice), so its caller sees one
uninterrupted stream; `count`, `status` and the responses store's get and put
are sent again, and so is a `prepare_off_loop` whose answer did not come.

`prepare_off_loop` and `stream` are one link call (`generate`): the engine
prepares the request, answers it, and streams it at once; the front's
`stream` of that request takes the events already on their way. A prepared
request nobody streams is cancelled there when it is dropped. A stream whose
`Finished` came sends no `cancel`. After
`MAX_RESUMES` breaks in a row with no new token, or no engine within the
wait, the stream fails with `EngineDown` (a retryable 503). Adapter loads and
fault arming are not sent again (they fail with `EngineDown`). Holds no MLX and
imports no engine code.
"""

from __future__ import annotations

import itertools
import logging
import math
import pickle
import weakref
from functools import partial
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from mlx_trio.errors import EngineDown, EngineFailure
from mlx_trio.events import Finished, GenerationEvent, TextDelta
from mlx_trio.link.remote_store import RemoteResponses
from mlx_trio.link.wire import FrameReader, LinkClosed, Message, Outbox, until_closed
from mlx_trio.output_format import OutputFormat
from mlx_trio.supervision import ChildSpec
from mlx_trio.supervision.faults import ArmedFault, FaultKind, Faults

log = logging.getLogger("mlx_trio.link")

# The front's own HTTP child (its faults are armed here, not in the engine process).
HTTP_ACTOR_ID = "http"
STATUS_FRESH_S = 0.1
RECONNECT_EVERY_S = 0.1
# How long a stream or call waits for the engine's process to be back (a model reload takes a while).
RESUME_WAIT_S = 300.0
# Link breaks in a row that bring a stream no new token before it fails.
MAX_RESUMES = 3
# Calls that are safe to send again after a break (they change nothing in the engine).
IDEMPOTENT = frozenset({"count", "status", "store_get", "store_put"})


class RemoteFaults(Faults):
    """Faults for "http" are this front's own; any other actor's are armed in the engine process.

    `arm` sends those on without waiting (`RemoteEngine.arm_fault` waits until the engine has it).
    `armed()` and `fired` are this front's and the engine's (as of the last status the front has: a
    caller that needs them now awaits `RemoteEngine.refresh_status` first).
    """

    def __init__(self, engine: RemoteEngine) -> None:
        super().__init__()
        self._engine = engine

    @property
    def fired(self) -> list[ArmedFault]:
        return [*super().fired, *self._engine.engine_faults("fired")]

    def arm(self, actor: str, kind: FaultKind | str) -> ArmedFault:
        if actor == HTTP_ACTOR_ID:
            return super().arm(actor, kind)
        fault = Faults().arm(actor, kind)  # the same checks, here, so a bad kind is a 400 at once
        self._engine.send_nowait(("arm", 0, (fault.actor, fault.kind.value)))
        return fault

    def armed(self) -> list[ArmedFault]:
        return [*super().armed(), *self._engine.engine_faults("armed")]


class RemoteEngine:
    """The engine of the process at the other end of the Unix socket `path`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.faults: Faults = RemoteFaults(self)
        self._ids = itertools.count(1)
        self._outbox: Outbox | None = None
        self._waiting: dict[int, trio.MemorySendChannel[tuple[str, Any]]] = {}
        self._facts: dict[str, Any] | None = None
        self._down = "the engine link is not connected yet"
        self._status: dict[str, Any] | None = None
        self._status_at = -math.inf
        self._status_wanted = trio.Event()
        self._engine_faults: dict[str, list[ArmedFault]] = {}
        self.connected = trio.Event()  # set at the first connection (tests, the front's start)
        # Set at the first facts that name a model. Their output format comes pickled and is unpickled at its
        # first read: that imports mlx-lm's tool parser (mlx-lm, MLX, transformers: most of a front's long-lived
        # objects; front_process reads it, then freezes them), which the launcher's own link never reads.
        self.model_known = trio.Event()
        self._format: tuple[bytes, OutputFormat] | None = None  # the last pickled format read, and it
        self._up = trio.Event()  # set while connected; a new one after each break
        self._links = 0  # connections made so far (a resume after `lost` waits for a newer one)
        # Streams `generate` started for a request `prepare_off_loop` returned, until `stream` takes them.
        self._prepared: dict[int, tuple[int, trio.MemoryReceiveChannel[tuple[str, Any]], int]] = {}
        # The front's own tree (its link and http children), shown beside the engine's in `status()`.
        self.local_status: Callable[[], dict[str, Any]] | None = None
        # The /v1/responses store every front shares, in the engine's process (the endpoint looks for it).
        self.responses_store = RemoteResponses(self._call)

    @property
    def child_spec(self) -> ChildSpec:
        return ChildSpec(id="engine-link", start=self.run, kind="link")

    # -- the link ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[RemoteEngine] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect (again after each break) and route what arrives, until cancelled."""
        task_status.started(self)
        while True:
            try:
                stream = await trio.open_unix_socket(self.path)
            except OSError as exc:
                self._down = f"the engine process is not reachable ({exc.strerror or exc})"
                await trio.sleep(RECONNECT_EVERY_S)
                continue
            try:
                await self._serve(stream)
            except LinkClosed as exc:
                self._down = f"the engine link broke ({exc}); reconnecting"
                log.warning("%s", self._down)
            finally:
                self._lost()
                await stream.aclose()
            await trio.sleep(RECONNECT_EVERY_S)

    async def _serve(self, stream: trio.SocketStream) -> None:
        """Route what arrives until the link breaks; raises that `LinkClosed`."""
        outbox = Outbox()
        reader = FrameReader(stream)

        async def read() -> None:
            while True:
                for message in await reader.receive():
                    self._route(message)

        self._outbox = outbox
        self._links += 1
        self.connected.set()
        self._up.set()
        raise await until_closed(partial(outbox.run, stream), read, self._refresh_status)

    def _route(self, message: Message) -> None:
        op, mid, payload = message
        if op == "facts":
            self._facts = payload
            if payload.get("model_id") is not None:
                self.model_known.set()
            return
        waiter = self._waiting.get(mid)
        if waiter is not None:  # else: a stream its caller left, or an arm nobody waits for
            waiter.send_nowait((op, payload))

    def _lost(self) -> None:
        """The link is gone: everything waiting on it hears so ("lost"), and resumes or fails."""
        self._outbox = None
        self._facts = None
        if self._up.is_set():
            self._up = trio.Event()
        for waiter in list(self._waiting.values()):
            try:
                waiter.send_nowait(("lost", None))
            except trio.WouldBlock:  # a call whose answer is already in
                pass
        self._waiting.clear()

    async def _link_up(self, newer_than: int = 0) -> int:
        """Once connected (by a connection after the `newer_than`-th): its number; `EngineDown` if none is
        within `RESUME_WAIT_S`."""
        with trio.move_on_after(RESUME_WAIT_S):
            while True:
                await self._up.wait()
                if self._links > newer_than:
                    return self._links
                await trio.sleep(RECONNECT_EVERY_S)  # the old engine still linked: the launcher is ending it
        raise EngineDown(f"{self._down}; retry", retry_after_s=1.0)

    def send_nowait(self, message: Message) -> None:
        if self._outbox is None:
            raise EngineDown(f"{self._down}; retry", retry_after_s=1.0)
        self._outbox.put_nowait(message)

    async def _call(self, op: str, payload: Any) -> Any:
        """One call's answer; sent again after a break when `op` is `IDEMPOTENT`."""
        while True:
            if op in IDEMPOTENT:
                await self._link_up()
            mid = next(self._ids)
            send, receive = trio.open_memory_channel[tuple[str, Any]](1)
            self._waiting[mid] = send
            try:
                self.send_nowait((op, mid, payload))
                kind, value = await receive.receive()
            finally:
                self._waiting.pop(mid, None)
            if kind == "lost" and op in IDEMPOTENT:
                continue
            if kind == "lost":
                raise EngineDown(f"the engine link broke during {op!r}; retry", retry_after_s=1.0)
            if kind == "err":
                raise value
            return value

    async def _refresh_status(self) -> None:
        """Fetch the engine's status when someone read a copy older than `STATUS_FRESH_S`."""
        while True:
            await self.refresh_status()
            await self._status_wanted.wait()
            self._status_wanted = trio.Event()

    async def refresh_status(self) -> None:
        """Fetch the engine's status (and faults) now."""
        status = await self._call("status", None)
        self._engine_faults = status.pop("faults", {})
        self._status, self._status_at = status, trio.current_time()

    def engine_faults(self, which: str) -> list[ArmedFault]:
        """The engine's "armed" or "fired" faults, as of the last status."""
        return list(self._engine_faults.get(which, ()))

    # -- EngineLike -----------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        if self._facts is None:
            return False, self._down
        ok, reason = self._facts["health"]
        return ok, reason

    @property
    def group_lost(self) -> str | None:
        return self._facts["group_lost"] if self._facts is not None else None

    def status(self) -> dict[str, Any]:
        """The engine's status (at most `STATUS_FRESH_S` old after the first read), with this front's children
        (`engine-link`, `http`, each marked with its front's id) after the engine's root children."""
        if trio.current_time() - self._status_at > STATUS_FRESH_S:
            self._status_wanted.set()
        status = dict(self._status or {"tree": {"id": "root", "kind": "supervisor", "children": []},
                                       "model": None, "counters": {}, "prompt_cache": {}, "ranks": []})
        if self.local_status is not None:  # this front's children (its http, as in one process) beside the engine's
            tree = dict(status.get("tree") or {})
            front = self.local_status()
            tree["children"] = [*tree.get("children", []),
                                *({**child, "front": front.get("id")} for child in front.get("children", []))]
            status["tree"] = tree
        return status

    def _fact(self, key: str) -> Any:
        value = self._facts.get(key) if self._facts is not None else None
        if value is None:
            raise EngineFailure("the model is not loaded yet" if self._facts is not None else self._down)
        return value

    @property
    def model_id(self) -> str:
        return str(self._fact("model_id"))

    @property
    def output_format(self) -> OutputFormat:
        raw: bytes = self._fact("output_format")
        if self._format is None or self._format[0] != raw:
            self._format = (raw, pickle.loads(raw))
        return self._format[1]

    @property
    def context_length(self) -> int | None:
        self._fact("model_id")  # raises while the model loads, as the engine's does
        assert self._facts is not None
        return self._facts["context_length"]

    def served_adapters(self) -> tuple[str, ...]:
        return tuple(self._facts["adapters"]) if self._facts is not None else ()

    def count_tokens(self, prompt: Any, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                     **kwargs: Any) -> int:
        """Blocking, from a worker thread (as the HTTP layer calls it): the engine counts."""
        return trio.from_thread.run(self._call, "count", (prompt, {"chat_template_kwargs": chat_template_kwargs,
                                                                   **kwargs}))

    async def prepare_off_loop(self, prompt: Any, **kwargs: Any) -> Any:
        """The engine's prepared request; its stream has started there already (`generate`), for `stream`."""
        while True:
            link = await self._link_up()
            mid = next(self._ids)
            send, receive = trio.open_memory_channel[tuple[str, Any]](math.inf)
            self._waiting[mid] = send
            try:
                self.send_nowait(("generate", mid, (prompt, kwargs)))
                kind, value = await receive.receive()
            except BaseException:
                self._waiting.pop(mid, None)
                self._cancel(mid)
                raise
            if kind == "lost":  # the link broke (or the group was lost) before the answer: send it again
                self._waiting.pop(mid, None)
                continue
            if kind == "err":
                self._waiting.pop(mid, None)
                raise value
            self._prepared[id(value)] = (mid, receive, link)
            weakref.finalize(value, self._unstreamed, id(value))
            return value

    def _unstreamed(self, key: int) -> None:
        """A prepared request was dropped without `stream`: its stream in the engine is cancelled."""
        taken = self._prepared.pop(key, None)
        if taken is not None:
            self._waiting.pop(taken[0], None)
            self._cancel(taken[0])

    def _cancel(self, mid: int) -> None:
        if self._outbox is not None:
            try:
                self._outbox.put_nowait(("cancel", mid, None))
            except trio.WouldBlock:  # a full outbox: the engine cancels it when the link ends
                log.warning("could not send the cancel of stream %d", mid)

    async def arm_fault(self, actor: str, kind: FaultKind | str) -> ArmedFault:
        """Arm a fault and return once it is armed where it fires (here for "http", else in the engine)."""
        if actor == HTTP_ACTOR_ID:
            return self.faults.arm(actor, kind)
        fault = Faults().arm(actor, kind)  # the same checks, here
        armed: ArmedFault = await self._call("arm", (fault.actor, fault.kind.value))
        return armed

    async def load_adapter(self, name: str, path: str) -> None:
        await self._call("load", (name, path))

    async def unload_adapter(self, name: str) -> None:
        await self._call("unload", name)

    async def stream(self, request: Any, *,
                     replay: Sequence[Sequence[int]] = ()) -> AsyncGenerator[GenerationEvent, None]:
        """The engine's `Engine.stream` of `request`, resumed across engine restarts; leaving before its
        `Finished` cancels it there (its KV is freed)."""
        chunks = [tuple(chunk) for chunk in replay]  # every chunk the caller has had (or was given to replay)
        attempt = stalled = 0
        started = self._prepared.pop(id(request), None)
        if started is not None and chunks:  # to be replayed: that stream began without the chunks
            self._waiting.pop(started[0], None)
            self._cancel(started[0])
            started = None
        link = 0  # the connection of this attempt: a resume waits for a newer one
        while True:
            if started is not None:  # `generate` started it with the prepare: its events are on their way
                (mid, receive, link), started = started, None
            else:
                link = await self._link_up(newer_than=link)
                mid = next(self._ids)
                send, receive = trio.open_memory_channel[tuple[str, Any]](math.inf)
                self._waiting[mid] = send
                # A resumed attempt under an id of its own: the new engine numbers its requests from 1 again.
                sent = request if attempt == 0 else attrs.evolve(request,
                                                                 request_id=f"{request.request_id}.r{attempt}")
                self.send_nowait(("stream", mid, (sent, tuple(chunks))))
            had = replayed = len(chunks)  # the engine first yields one TextDelta for each replayed chunk
            ended = False
            why = "the engine link broke"
            try:
                while True:
                    kind, value = await receive.receive()
                    if kind == "event":
                        if isinstance(value, TextDelta):
                            if replayed:
                                replayed -= 1
                                if attempt > 0:
                                    continue  # the caller has it from an earlier attempt
                            elif value.token_ids:
                                chunks.append(tuple(value.token_ids))
                        elif isinstance(value, Finished):
                            ended = True  # nothing left to cancel there, whether or not the caller reads on
                        yield value
                        continue
                    if kind == "lost":
                        why = f"the engine's scale-out group was lost ({value})" if value else why
                        break
                    ended = True
                    if kind == "err":
                        raise value
                    return
            finally:
                self._waiting.pop(mid, None)
                if not ended:
                    self._cancel(mid)
            stalled = 0 if len(chunks) > had else stalled + 1
            if stalled > MAX_RESUMES:
                raise EngineDown(f"request {request.request_id}: the engine was lost {stalled} times "
                                 "in a row with no new token; retry", retry_after_s=1.0)
            attempt += 1
            log.warning("request %s: %s; resuming after %d chunk(s)", request.request_id, why, len(chunks))
