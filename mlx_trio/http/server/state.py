"""What the handlers share: the engine (as the small surface they use), the config, counters, drain, metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Protocol

import attrs
import trio

from mlx_trio.errors import MlxTrioError
from mlx_trio.events import GenerationEvent
from mlx_trio.http.server.config import ServerConfig
from mlx_trio.http.server.drain import Drain
from mlx_trio.http.server.prometheus import Metrics
from mlx_trio.output_format import OutputFormat
from mlx_trio.supervision.child import describe_error
from mlx_trio.supervision.faults import Faults


class EngineLike(Protocol):
    """What the HTTP layer needs from `mlx_trio.api.Engine`.

    An engine may also have a `responses_store` (http/responses/store.py `Responses`): a front
    process's `RemoteEngine` does (the one store in the engine's process, shared by every front);
    the Responses endpoint uses it instead of a store of its own. `Engine` and the fakes have none.
    Likewise `async refresh_status()`: an engine whose `status()` is a copy (a `RemoteEngine`) fetches
    it anew there; `fresh_status` (fresh_status.py) awaits it before every read a client may compare with what it
    was just answered.
    """

    # Armed by tests and POST /v1/admin/faults; the HTTP child checks "http" at each request.
    faults: Faults

    def health(self) -> tuple[bool, str]: ...

    def status(self) -> dict[str, Any]: ...

    @property
    def model_id(self) -> str: ...  # raises an MlxTrioError while the model loads

    @property
    def output_format(self) -> OutputFormat: ...  # the model's reasoning and tool-call markers

    @property
    def context_length(self) -> int | None: ...  # raises an MlxTrioError while the model loads

    def count_tokens(self, prompt: Any, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                     **kwargs: Any) -> int: ...  # what prepare_off_loop would prefill; blocking (a worker thread)

    async def prepare_off_loop(self, prompt: Any, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                               **sampling: Any) -> Any: ...  # also takes tools=[...] (only when a request has tools)

    def stream(self, request: Any) -> AsyncIterator[GenerationEvent]: ...

    def served_adapters(self) -> tuple[str, ...]: ...  # adapter names a body's `model` may give (may be empty)

    async def load_adapter(self, name: str, path: str) -> None: ...  # only with --enable-lora-admin

    async def unload_adapter(self, name: str) -> None: ...  # returns once no request uses it


@asynccontextmanager
async def closing(events: AsyncIterator[GenerationEvent]) -> AsyncIterator[AsyncIterator[GenerationEvent]]:
    """Close an `Engine.stream` on exit, however the block is left.

    `Engine.stream` is an async generator: closing it is how a request is
    cancelled in the engine (its KV cache freed), so a client that goes away
    must never leave it to the garbage collector.
    """
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


@attrs.define
class HandlerCrashes:
    """Requests whose own handler crashed: an unexpected exception, answered 500 `internal_error`
    (in its API's shape, in-band once a stream's headers are out). Trio-thread only.

    Each crash ends its own request only; hypercorn runs every request in a task
    of its own, so nothing else is touched. Owned by the `HttpServer`, so the
    count survives restarts of its child; shown as the `http` node's `stats`.
    """

    count: int = 0
    last_error: str | None = None

    def record(self, error: BaseException) -> None:
        self.count += 1
        self.last_error = describe_error(error)


@attrs.define
class AppState:
    """What one incarnation of the app shares: engine, config, counters, drain, metrics, crash signal.

    `drain` and `metrics` belong to the `HttpServer` and outlive a restart of
    the HTTP child; the rest is per incarnation.
    """

    engine: EngineLike
    config: ServerConfig
    drain: Drain
    metrics: Metrics
    # Belongs to the `HttpServer` like `drain`; a fresh one for an app built alone.
    crashes: HandlerCrashes = attrs.field(factory=HandlerCrashes)
    started_at: int = attrs.field(factory=lambda: int(time.time()))
    # Requests handed to the engine since start (the /stats `submitted_rows`).
    submitted_rows: int = 0
    # Set when this incarnation's server task is being stopped (hypercorn's own graceful shutdown).
    stopping: bool = False
    # A listener that must die (the `kill-listener` fault) sets these; `HttpServer.run` raises the
    # error from the server task, so the supervisor restarts the child (see `crash`).
    crash_error: BaseException | None = None
    crashed: trio.Event = attrs.field(factory=trio.Event)

    @property
    def draining(self) -> bool:
        """True once a drain or a shutdown began: /health turns 503, new completions are refused."""
        return self.stopping or self.drain.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.stopping = value

    def crash(self, error: BaseException) -> None:
        """Make the server task raise `error`, as when the listener itself dies.

        An exception raised in a handler only fails its request (`crashes`
        counts it): hypercorn runs each request in its own task. To kill the
        whole server a handler stashes the error here instead; `HttpServer.run`
        waits on `crashed`, cancels hypercorn (every connection is cut, as when
        a process dies) and raises the error from the supervised task.
        """
        if self.crash_error is None:
            self.crash_error = error
        self.crashed.set()

    def model_name(self) -> str:
        """The served model id; never empty, even while the model loads."""
        if self.config.model_name:
            return self.config.model_name
        try:
            return self.engine.model_id
        except MlxTrioError:
            return "default"
