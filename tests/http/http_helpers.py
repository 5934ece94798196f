"""Helpers for the HTTP tests: live servers (fake engine, or a tiny real model in a thread), checks.

The `openai` SDK and hypothesis are synchronous, so the real-model server runs
in a background thread with its own `trio.run` (`ServerThread`), shared by a
module; tests talk to it over HTTP like any client would.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import trio


from tests.http.fakes import FakeEngine

from mlx_trio.config import EngineConfig
from mlx_trio.http import HttpServer, ServerConfig
from mlx_trio.params import SamplingParams

T = TypeVar("T")

# The first request on a cold CPU box compiles kernels; keep clients patient, tests short.
CLIENT_TIMEOUT_S = 60.0


@asynccontextmanager
async def serve_fake(engine: FakeEngine | None = None,
                     **config: Any) -> AsyncIterator[tuple[HttpServer, httpx.AsyncClient]]:
    """Serve `engine` (a fresh FakeEngine by default) on a random port; yield the server and a client."""
    server = HttpServer(ServerConfig(port=0, **config), engine if engine is not None else FakeEngine())
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            yield server, client
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def served_engine(**config: Any) -> AsyncIterator[tuple[HttpServer, Any]]:
    """A tiny real model with the HTTP server as its child (as `mlx-trio serve` runs it), in this Trio loop.

    `config` goes to the `ServerConfig` (port 0); yields the server and the `mlx_trio.api.Engine`.
    """
    from mlx_trio.api import Engine  # noqa: PLC0415  (imports MLX: only the real-model tests pay for it)

    server = HttpServer(ServerConfig(port=0, **config))
    engine = Engine(tiny_engine_config(), extra_children=[server.child_spec])
    server.attach(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        with trio.fail_after(60):
            await engine.wait_ready()
        yield server, engine
        await engine.report_leaks()  # closed with every request ended: a pool still held fails the test
        nursery.cancel_scope.cancel()


class ServerThread:
    """`mlx_trio.cli.serve` (engine + HTTP child) in a thread with its own Trio loop."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        self._engine_config = engine_config
        self._server_config = server_config
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self.server: HttpServer | None = None
        self._thread = threading.Thread(target=self._run, name="mlx-trio-test-server", daemon=True)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def start(self, timeout_s: float = 120.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the test server did not become ready")
        if self._error is not None:
            raise self._error
        return self

    def __enter__(self) -> ServerThread:
        """Started (here, unless `start` already ran with its own timeout); stopped on exit."""
        return self if self._thread.is_alive() else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a sync function on the server's Trio thread (e.g. `server.state.engine.status`)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def report_leaks(self) -> list[str]:
        """What the engine still holds with every request ended (logged on the leak log, `mlx_trio.api.leaks_log`; [] mid-stream)."""
        assert self.server is not None and self.server.engine is not None
        return trio.from_thread.run(self.server.engine.report_leaks, trio_token=self._token)

    def stop(self) -> None:
        if self._cancel is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
        self._thread.join(30)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # noqa: BLE001  (reported to the test thread)
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        from mlx_trio.cli import serve  # noqa: PLC0415  (imports the engine, hence MLX)

        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._cancel = nursery.cancel_scope
            self.server = await nursery.start(serve, self._engine_config, self._server_config)
            self._ready.set()


@asynccontextmanager
async def cli_server(tmp_path: Path, *flags: str) -> AsyncIterator[tuple[subprocess.Popen[str], str]]:
    """`mlx-trio serve` on the tiny model in a subprocess; yields it and its URL; kills it if still alive."""
    runner = "import sys; from mlx_trio.cli import main; sys.exit(main())"
    log = (tmp_path / "server.log").open("w")  # a file, not a pipe: a full pipe would stall the server
    proc = subprocess.Popen(
        [sys.executable, "-c", runner, "serve", "--model", str(tiny_engine_config().model), "--port", "0",
         "--log-level", "INFO", *flags],
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=Path(__file__).parents[2],
    )
    try:
        assert proc.stdout is not None
        with trio.fail_after(60):
            line = await trio.to_thread.run_sync(proc.stdout.readline)
        assert "serving" in line, line + (tmp_path / "server.log").read_text()
        yield proc, line.split(" at ")[1].split("/v1")[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        await trio.to_thread.run_sync(proc.wait)
        log.close()


def tiny_engine_config(**defaults: Any) -> EngineConfig:
    """A tiny Llama on the batch lane (the default --batch auto), 8 tokens per request unless asked."""
    from mlx_trio.testing.tiny_models import LLAMA, tiny_model  # noqa: PLC0415

    return EngineConfig(model=str(tiny_model(LLAMA)), defaults=SamplingParams(**{"max_tokens": 8, **defaults}))




def assert_openai_error(response: httpx.Response, status: int, *, code: str | None = None,
                        param: str | None = None) -> dict[str, Any]:
    """The response is `status` with an OpenAI error object; returns the object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def sse_events(text: str) -> list[str]:
    """The events of an SSE body, comments included, in order (each without its blank-line terminator)."""
    assert text.endswith("\n\n"), text[-200:]
    return text[:-2].split("\n\n")
