"""`Launcher`: `mlx-trio serve`'s own process (with `--api-server-count` N > 0), which holds neither MLX nor HTTP.

It starts the engine (engine_keeper.py: one engine process, or the N rank
processes of `--tensor-parallel N` / `--pipeline-parallel N`, rank 0 running
the engine and the link server) and the front pool (front_pool.py: the public
socket and N front processes), and keeps both running:

* the engine is started again whenever it is lost after it was ready once
  (its process crashed or was killed, any rank died, or rank 0 reports its
  group lost: a follower hung): its fronts keep their clients' connections
  and resume each stream on the new one from the tokens already sent
  (link/remote_engine.py), so a client sees one uninterrupted answer; an
  engine that is lost before it was ever ready is a model that cannot load,
  and the launcher fails with the engine's own words;
* a front that exits unasked is started again by the pool.

It watches the engine through a link of its own (`RemoteEngine`: health and
model id for the "serving" line, and the group's loss). `drain` drains the fronts, then stops the
engine (SIGTERM: it flushes the prompt cache's SSD tier). SIGUSR1 (the
profile's mark) is passed on to the engine's process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from mlx_trio.config import EngineConfig
from mlx_trio.errors import ModelLoadError
from mlx_trio.http.server.config import ServerConfig
from mlx_trio.link.remote_engine import RemoteEngine
from mlx_trio.processes.engine_keeper import EngineKeeper
from mlx_trio.processes.front_pool import FrontPool, link_socket_path
from mlx_trio.profiling import MARK_SIGNAL

if TYPE_CHECKING:  # only annotations: it imports Quart, ~0.15 s before the engine process is started
    from mlx_trio.http.server.drain import DrainReport

log = logging.getLogger("mlx_trio.processes")

LOAD_PROGRESS_EVERY_S = 5.0
# How often the launcher's own link is asked whether rank 0 lost its group (the facts come every 50 ms).
GROUP_CHECK_S = 0.05


class Launcher:
    """The engine (its process, or its `ranks` rank processes) and `server_config.api_server_count` fronts, as one
    server; `started(self)` when ready. `pipeline`: the ranks split the model by layers, not tensor parallel."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, workdir: Path, *,
                 ranks: int = 1, pipeline: bool = False) -> None:
        self.config = server_config
        link_path = link_socket_path(workdir)
        self.keeper = EngineKeeper(engine_config, link_path, workdir,
                                   responses_store_bytes=server_config.responses_store_bytes, ranks=ranks,
                                   pipeline=pipeline)
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
            nursery.start_soon(self._watch_group)
            ranks = f" on {self.keeper.ranks} ranks" if self.keeper.ranks > 1 else ""
            print(f"mlx-trio: serving {self.watch.model_id}{ranks} at {self.url}/v1 from "
                  f"{self.config.api_server_count} front process(es) (status page: {self.url}/status, "
                  f"health: {self.url}/health)", flush=True)
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
        while not self.pool.ready:  # each front's own link too (front_process._say_ready): any front may answer
            if time.monotonic() - next_log > LOAD_PROGRESS_EVERY_S:
                next_log = time.monotonic()
                log.info("waiting for the front processes to reach the engine (%.0f s)", next_log - start)
            await trio.sleep(0.05)

    async def _watch_group(self) -> None:
        """A rank 0 that lost its group (a follower hung: no process exited) ends its generation."""
        while True:
            lost = self.watch.group_lost
            if lost is not None:
                self.keeper.lose(f"rank 0 lost its group ({lost})")
            await trio.sleep(GROUP_CHECK_S)

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
