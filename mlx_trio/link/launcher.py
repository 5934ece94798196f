"""`Launcher`: `mlx-trio serve --api-server-count N`'s own process, which holds neither MLX nor HTTP.

It starts the engine's process (engine_process.py) and the front pool
(front_pool.py: the public socket and N front processes), and keeps both
running:

* the engine's process is started again whenever it exits unasked after it
  was ready once (a crash, the OOM killer): its fronts keep their clients'
  connections and resume each stream on the new one from the tokens already
  sent (remote_engine.py), so a client sees one uninterrupted answer; one
  that exits before it was ever ready is a model that cannot load, and the
  launcher fails with the engine's own words;
* a front that exits unasked is started again by the pool.

It watches the engine through a link of its own (`RemoteEngine`: health and
model id for the "serving" line). `drain` drains the fronts, then stops the
engine (SIGTERM: it flushes the prompt cache's SSD tier). SIGUSR1 (the
profile's mark) is passed on to the engine's process.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path

import trio

from mlx_trio.config import EngineConfig
from mlx_trio.errors import ModelLoadError
from mlx_trio.http.server.config import ServerConfig
from mlx_trio.http.server.drain import DrainReport
from mlx_trio.link.front_pool import FrontPool, link_socket_path, run_process, stop_process
from mlx_trio.link.remote_engine import RemoteEngine
from mlx_trio.profiling import MARK_SIGNAL

log = logging.getLogger("mlx_trio.link")

RESTART_DELAY_S = 0.5
STOP_GRACE_S = 35.0  # the engine's SSD flush (engine_process.FLUSH_LIMIT_S) and a margin
LOAD_PROGRESS_EVERY_S = 5.0


class EngineKeeper:
    """The engine's process: started, watched, started again after a crash; `generation` counts the starts."""

    def __init__(self, config: EngineConfig, link_path: str, workdir: Path, *, responses_store_bytes: int) -> None:
        self._config_path = workdir / "engine-config.pickle"
        self._config_path.write_bytes(pickle.dumps(config))
        self._error_path = workdir / "engine-error.txt"
        self._link_path = link_path
        self._responses_store_bytes = responses_store_bytes  # the fronts' one /v1/responses store, kept there
        self.process: trio.Process | None = None
        self.generation = 0
        self.ready_once = False  # set by the launcher once the engine answered healthy
        self.failed: str | None = None  # why the first engine process never became ready
        self.stopping = False

    async def run(self, *, task_status: trio.TaskStatus[EngineKeeper] = trio.TASK_STATUS_IGNORED) -> None:
        command = [sys.executable, "-m", "mlx_trio.link.engine_process", "--link", self._link_path,
                   "--config", str(self._config_path), "--error-file", str(self._error_path),
                   "--responses-store-bytes", str(self._responses_store_bytes),
                   "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
        def started(process: trio.Process) -> None:
            self.process = process
            self.generation += 1
            if self.generation == 1:
                task_status.started(self)

        while True:
            self._error_path.unlink(missing_ok=True)
            code = await run_process(command, grace_s=STOP_GRACE_S, on_start=started)
            process = self.process
            assert process is not None
            if self.stopping:
                return
            why = self._error_path.read_text() if self._error_path.exists() else f"exit status {code}"
            if not self.ready_once:
                self.failed = why
                return
            log.error("the engine's process (pid %d) died (%s); starting it again: the fronts resume its streams",
                      process.pid, why)
            await trio.sleep(RESTART_DELAY_S)

    async def stop(self) -> None:
        self.stopping = True
        if self.process is not None and self.process.returncode is None:
            await stop_process(self.process, STOP_GRACE_S)


class Launcher:
    """The engine's process and `server_config.api_server_count` fronts, as one server; `started(self)` when ready."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, workdir: Path) -> None:
        self.config = server_config
        link_path = link_socket_path(workdir)
        self.keeper = EngineKeeper(engine_config, link_path, workdir,
                                   responses_store_bytes=server_config.responses_store_bytes)
        self.pool = FrontPool(server_config, link_path, workdir)
        self.watch = RemoteEngine(link_path)
        self.engine = None  # nothing to flush here: the engine's process flushes its own SSD tier
        self._label = engine_config.model or "(default)"

    @property
    def url(self) -> str:
        return self.pool.url

    @property
    def port(self) -> int | None:
        return self.pool.port

    def pids(self) -> list[int]:
        """The front processes' pids (tests kill them)."""
        return self.pool.pids()

    @property
    def engine_pid(self) -> int | None:
        process = self.keeper.process
        return process.pid if process is not None and process.returncode is None else None

    async def run(self, *, task_status: trio.TaskStatus[Launcher] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.keeper.run)
            await nursery.start(self.pool.run)
            await nursery.start(self.watch.run)
            if MARK_SIGNAL is not None and _main_thread():
                nursery.start_soon(self._forward_marks)
            await self._wait_ready()
            print(f"mlx-trio: serving {self.watch.model_id} at {self.url}/v1 from {self.config.api_server_count} "
                  f"front process(es) (status page: {self.url}/status, health: {self.url}/health)", flush=True)
            task_status.started(self)

    async def _wait_ready(self) -> None:
        start = next_log = time.monotonic()
        log.info("listening on %s; loading model %s", self.url, self._label)
        while not self.watch.health()[0]:
            if self.keeper.failed is not None:
                raise ModelLoadError(self.keeper.failed)
            if time.monotonic() - next_log > LOAD_PROGRESS_EVERY_S:
                next_log = time.monotonic()
                log.info("still loading the model (%.0f s)", next_log - start)
            await trio.sleep(0.05)
        self.keeper.ready_once = True
        log.info("model %s ready in %.1f s", self.watch.model_id, time.monotonic() - start)

    async def _forward_marks(self) -> None:
        assert MARK_SIGNAL is not None
        with trio.open_signal_receiver(MARK_SIGNAL) as marks:
            async for signum in marks:
                pid = self.engine_pid
                if pid is not None:
                    os.kill(pid, signum)

    async def drain(self, timeout_s: float | None = None) -> DrainReport:
        """Drain the fronts (each its own requests), then stop the engine's process (it flushes its SSD tier)."""
        report = await self.pool.drain(timeout_s)
        await self.keeper.stop()
        return report


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
