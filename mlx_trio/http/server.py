"""`HttpServer`: the app on hypercorn's Trio worker, as a supervised child.

`HttpServer.run` is a `ChildSpec.start` function: it binds the socket, calls
`task_status.started(self)` (so `port` is known, even when configured as 0),
and serves until cancelled. Cancellation drains: hypercorn stops accepting,
in-flight requests get `graceful_timeout_s` to finish, then are cancelled.
"""

from __future__ import annotations

import logging
from typing import cast
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from hypercorn.typing import ASGIFramework

from mlx_trio.http.app import create_app
from mlx_trio.http.asgi import DrainRequestBody
from mlx_trio.http.config import ServerConfig
from mlx_trio.http.state import AppState, EngineLike
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
        # Invariant: `port` is the bound port while `run` serves; None before.
        self.port: int | None = None

    def attach(self, engine: EngineLike) -> None:
        self._engine = engine

    @property
    def child_spec(self) -> ChildSpec:
        return ChildSpec(id="http", start=self.run, kind="http",
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

    async def run(self, *, task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report `started(self)`, serve until cancelled; then drain (bounded) and return."""
        if self._engine is None:
            raise RuntimeError("HttpServer.run needs an engine: pass it to the constructor or attach() it")
        app = create_app(self._engine, self.config)
        self._state = app.extensions["mlx_trio"]
        shutdown = trio.Event()
        serve_scope = trio.CancelScope(shield=True)

        async def _serve(*, task_status: trio.TaskStatus[list[str]]) -> None:
            # Shielded, so our cancellation turns into a graceful shutdown instead of cutting
            # every connection; the deadline set below bounds the drain.
            with serve_scope:
                asgi_app = cast(ASGIFramework, DrainRequestBody(app))
                await serve(asgi_app, _hypercorn_config(self.config), mode="asgi",
                            shutdown_trigger=shutdown.wait, task_status=task_status)

        try:
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(_serve)
                self.port = _port(binds)
                log.info("listening on %s", self.url)
                task_status.started(self)
                try:
                    await trio.sleep_forever()
                finally:
                    self._state.draining = True
                    shutdown.set()
                    serve_scope.deadline = trio.current_time() + self.config.graceful_timeout_s + _SHUTDOWN_SLACK_S
        finally:
            self.port = None


def _hypercorn_config(config: ServerConfig) -> HypercornConfig:
    hyper = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hyper.bind = [f"{host}:{config.port}"]
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

