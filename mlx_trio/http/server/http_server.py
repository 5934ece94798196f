"""`HttpServer`: the app on hypercorn's Trio worker, as a supervised child.

`HttpServer.run` is a `ChildSpec.start` function: it binds the socket, calls
`task_status.started(self)` (so `port` is known, even when configured as 0),
and serves until cancelled. Cancellation is a short graceful stop: hypercorn
stops accepting, in-flight requests get `graceful_timeout_s` to finish, then
are cancelled. The long, polite stop is `drain` (SIGTERM in `mlx-trio serve`),
called before the tree is cancelled.

A crash of one request's handler (a bug, or a `raise` fault armed for "http":
see `admin`) fails that request only; `statistics()` counts them, so the
status tree shows them on the `http` node. `run` raises only when the
listener itself dies (the `kill-listener` fault stands for that): every
connection is cut, the supervisor restarts the child, and the new incarnation
binds the same port again (hypercorn sets SO_REUSEADDR; a port configured as 0
sticks to the one first bound). The drain state, the Prometheus metrics and
the handler-crash count belong to the `HttpServer`, so they survive the restart.
"""

from __future__ import annotations

import logging
import os
from typing import cast
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from hypercorn.typing import ASGIFramework

from mlx_trio.http.server.admin import HTTP_ACTOR_ID
from mlx_trio.http.server.app import create_app, server_metrics
from mlx_trio.http.server.asgi import CountInFlight, DrainRequestBody, WriteTimeout
from mlx_trio.http.server.config import ServerConfig
from mlx_trio.http.server.drain import Drain, DrainReport
from mlx_trio.http.server.prometheus import Metrics
from mlx_trio.http.server.state import AppState, EngineLike, HandlerCrashes
from mlx_trio.supervision import ChildSpec

log = logging.getLogger("mlx_trio.http")

# Past the graceful period, hypercorn's own lifespan shutdown needs a moment.
_SHUTDOWN_SLACK_S = 2.0


class HttpServer:
    """Serves one engine over HTTP; the handle its supervisor holds.

    Build it before the engine when it is to be the engine's child (the engine
    takes `child_spec` in its constructor), then `attach` the engine.
    """

    def __init__(self, config: ServerConfig, engine: EngineLike | None = None) -> None:
        self.config = config
        self._engine = engine
        self._state: AppState | None = None
        self.drain_state = Drain()
        self.crashes = HandlerCrashes()
        self._metrics: Metrics | None = None
        # Invariant: `port` is the bound port while `run` serves; None before and between restarts.
        self.port: int | None = None
        # The port first bound; a restart binds it again even when `config.port` is 0.
        self._bound_port: int | None = None

    def attach(self, engine: EngineLike) -> None:
        self._engine = engine

    @property
    def engine(self) -> EngineLike:
        if self._engine is None:
            raise RuntimeError("no engine attached")
        return self._engine

    @property
    def child_spec(self) -> ChildSpec:
        return ChildSpec(id=HTTP_ACTOR_ID, start=self.run, kind="http",
                         shutdown_s=self.config.graceful_timeout_s + 2 * _SHUTDOWN_SLACK_S)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server is not listening yet")
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def state(self) -> AppState:
        if self._state is None:
            raise RuntimeError("the server has not started")
        return self._state

    @property
    def metrics(self) -> Metrics:
        if self._metrics is None:
            self._metrics = server_metrics(self.engine, self.drain_state)
        return self._metrics

    def statistics(self) -> dict[str, object]:
        """The `http` node's `stats` in the status tree: the requests whose handler crashed."""
        return {"handler_crashes": self.crashes.count, "last_handler_error": self.crashes.last_error}

    async def drain(self, timeout_s: float | None = None) -> DrainReport:
        """Stop admitting completions and wait for running ones, up to `timeout_s`; then cut the rest.

        Default timeout: `config.shutdown_timeout_s`. Keeps serving /health
        (503 "draining"), /metrics and /v1/status meanwhile. Stop the server
        (cancel `run`) afterwards; draining is for good.
        """
        return await self.drain_state.run(self.config.shutdown_timeout_s if timeout_s is None else timeout_s)

    async def run(self, *, task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report `started(self)`, serve until cancelled; then stop (bounded) and return.

        Raises the injected error if the listener was killed (`AppState.crash`).
        """
        app = create_app(self.engine, self.config, drain=self.drain_state, metrics=self.metrics,
                         crashes=self.crashes)
        state = self._state = app.extensions["mlx_trio"]
        shutdown = trio.Event()
        serve_scope = trio.CancelScope(shield=True)

        async def _serve(*, task_status: trio.TaskStatus[list[str]]) -> None:
            # Shielded, so our cancellation turns into a graceful shutdown instead of cutting
            # every connection; the deadline set below bounds it.
            with serve_scope:
                body = DrainRequestBody(app, timeout_s=self.config.body_timeout_s, drain=self.drain_state)
                guarded = WriteTimeout(body, self.drain_state, timeout_s=self.config.write_timeout_s)
                asgi_app = cast(ASGIFramework, CountInFlight(guarded, self.drain_state))
                await serve(asgi_app, self._hypercorn_config(), mode="asgi",
                            shutdown_trigger=shutdown.wait, task_status=task_status)

        try:
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(_serve)
                self.port = self._bound_port = _port(binds)
                log.info("listening on %s", self.url)
                task_status.started(self)
                crashed = False
                try:
                    await state.crashed.wait()
                    crashed = True
                    # A crash, not a stop: cut every connection now, as a dying process would.
                    serve_scope.cancel()
                finally:
                    if not crashed:
                        state.stopping = True
                        shutdown.set()
                        serve_scope.deadline = trio.current_time() + self.config.graceful_timeout_s + _SHUTDOWN_SLACK_S
        finally:
            self.port = None
        # Outside the nursery, so the supervisor sees the error itself, not an ExceptionGroup around it.
        assert state.crash_error is not None  # the wait above only returns after `crash`
        raise state.crash_error

    def _hypercorn_config(self) -> HypercornConfig:
        config = self.config
        hyper = HypercornConfig()
        host = f"[{config.host}]" if ":" in config.host else config.host
        if config.listen_fd is not None:
            # A duplicate each time: hypercorn closes the socket it served when it stops, and a
            # restarted child must serve the inherited one again.
            hyper.bind = [f"fd://{os.dup(config.listen_fd)}"]
        else:
            hyper.bind = [f"{host}:{self._bound_port or config.port}"]
        hyper.accesslog = None  # one line per completion comes from RequestLog instead
        hyper.errorlog = logging.getLogger("hypercorn.error")
        hyper.graceful_timeout = config.graceful_timeout_s
        return hyper


def _port(binds: list[str]) -> int:
    for bind in binds:
        port = urlsplit(bind).port
        if port is not None:
            return port
    raise RuntimeError(f"hypercorn reported no bound port: {binds}")
