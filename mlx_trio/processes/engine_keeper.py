"""`EngineKeeper`: the engine's process, or the N rank processes that together are the engine; kept running.

One generation is either one engine process (`ranks` 1) or `ranks` processes of
the same program, each with `MLX_RANK` and `MLX_HOSTFILE` set as mlx.launch's
ring backend sets them (a hostfile of one loopback port per rank, fresh ports
for every generation). Rank 0 runs the engine and the link server; the others
run only the follower loop (engine_process.py). To the fronts both shapes are
one engine at the end of the link.

A generation ends when any of its processes exits unasked, or when rank 0
says its group is lost (`lose`, from the launcher, which reads the engine's
`group_lost` over its own link: a follower that hangs exits nothing). The
whole generation is then killed (SIGKILL: a rank cannot re-form a group
inside its process, and a collective waiting on a dead or hung peer cannot
be cancelled, so every rank of a lost group must end; nothing of it is worth
a grace: the fronts resume every stream on the next one) and a new one is
started (at once; after a growing delay when losses come in a row:
`restart_delay`). That is the same restart a crash of the one engine
process gets, so a front cannot tell them apart.

A generation that never became ready (`ready_once` unset: the model cannot
load, a flag the group refuses) ends the keeper with `failed` set to the
engine's own words (its error file). `stop` asks rank 0 to stop (SIGTERM: it
flushes the SSD tier and stops its followers), then kills what is left.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path

import trio

from mlx_trio.config import EngineConfig

log = logging.getLogger("mlx_trio.processes")

# A first loss is started again at once (the fronts' streams wait on it); losses in a row within
# `LOSS_WINDOW_S` wait RESTART_DELAY_S, doubling each time, up to MAX_RESTART_DELAY_S (a crash loop).
RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 30.0
LOSS_WINDOW_S = 60.0
STOP_GRACE_S = 35.0  # the engine's SSD flush (engine_process.FLUSH_LIMIT_S) and a margin
# How long the followers may take to exit once rank 0 stopped them (they see STOP at their next receive).
FOLLOWER_EXIT_S = 10.0
RANK_ENV = "MLX_RANK"  # as mlx.launch sets them (engine/distributed/world.py reads them)
HOSTFILE_ENV = "MLX_HOSTFILE"


class EngineKeeper:
    """The engine's process (or its `ranks` rank processes): started, watched, started again when lost.

    `generation` counts the starts; `processes` is the current generation's, rank 0 first. `program` is
    what each process runs (another program only in tests); it gets the engine process's flags after it.
    """

    def __init__(self, config: EngineConfig, link_path: str, workdir: Path, *, responses_store_bytes: int,
                 ranks: int = 1, pipeline: bool = False, program: list[str] | None = None) -> None:
        self._config_path = workdir / "engine-config.pickle"
        self._config_path.write_bytes(pickle.dumps(config))
        self._error_path = workdir / "engine-error.txt"
        self._hostfile = workdir / "ranks.json"
        self._link_path = link_path
        self._responses_store_bytes = responses_store_bytes  # the fronts' one /v1/responses store, kept there
        self._program = program or [sys.executable, "-m", "mlx_trio.processes.engine_process"]
        self.ranks = ranks
        self.pipeline = pipeline
        self.processes: list[trio.Process] = []
        self.generation = 0
        self.ready_once = False  # set by the launcher once the engine answered healthy
        self.failed: str | None = None  # why the first generation never became ready
        self.lost: deque[tuple[float, str]] = deque(maxlen=32)  # (time.monotonic(), why) of the last ones lost
        self.stopping = False
        self._end = trio.Event()  # set to end the current generation (`lose`, `stop`)
        self._why = ""

    @property
    def process(self) -> trio.Process | None:
        """Rank 0's process (the one engine process when `ranks` is 1), once started."""
        return self.processes[0] if self.processes else None

    def command(self) -> list[str]:
        flags = ["--link", self._link_path, "--config", str(self._config_path),
                 "--error-file", str(self._error_path), "--responses-store-bytes", str(self._responses_store_bytes),
                 "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
        return [*self._program, *flags, *(["--pipeline"] if self.pipeline else [])]

    async def run(self, *, task_status: trio.TaskStatus[EngineKeeper] = trio.TASK_STATUS_IGNORED) -> None:
        """Generations until stopped, or until the first never became ready (`failed`)."""
        while not self.stopping:
            self._error_path.unlink(missing_ok=True)
            self._end = trio.Event()
            why = await self._one_generation(task_status)
            if self.stopping:
                return
            if not self.ready_once:
                self.failed = self._error_path.read_text() if self._error_path.exists() else why
                return
            now = time.monotonic()
            self.lost.append((now, why))
            delay = restart_delay([at for at, _ in self.lost], now)
            log.error("the engine was lost (%s); starting %s again%s: the fronts resume its streams", why,
                      "its process" if self.ranks == 1 else f"its {self.ranks} ranks",
                      f" in {delay:g} s" if delay else "")
            await trio.sleep(delay)

    def lose(self, why: str) -> None:
        """End the current generation (its group is lost), as if one of its processes had died."""
        if not self._end.is_set():
            self._why = why
            self._end.set()

    async def stop(self) -> None:
        """Rank 0 stops (SIGTERM: it flushes its SSD tier and stops its followers); what remains is killed."""
        self.stopping = True
        processes = list(self.processes)
        if not processes:
            return
        leader, followers = processes[0], processes[1:]
        if leader.returncode is None:
            leader.send_signal(signal.SIGTERM)
            with trio.move_on_after(STOP_GRACE_S):
                await leader.wait()
        with trio.move_on_after(FOLLOWER_EXIT_S if leader.returncode is not None else 0):
            for process in followers:
                await process.wait()
        self._end.set()
        await _kill(processes)

    async def _one_generation(self, task_status: trio.TaskStatus[EngineKeeper]) -> str:
        """Start the processes, wait until one exits or the generation is lost, kill the rest: why it ended."""
        self.generation += 1
        env = dict(os.environ)
        if self.ranks > 1:
            ports = free_ports(self.ranks)
            self._hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
            env[HOSTFILE_ENV] = str(self._hostfile)
        processes: list[trio.Process] = []
        try:
            for rank in range(self.ranks):
                extra = {RANK_ENV: str(rank)} if self.ranks > 1 else {}
                processes.append(await trio.lowlevel.open_process(self.command(), env={**env, **extra}))
            self.processes = processes
            if self.generation == 1:
                task_status.started(self)
            async with trio.open_nursery() as nursery:
                for rank, process in enumerate(processes):
                    nursery.start_soon(self._exited, rank, process)
                await self._end.wait()
                nursery.cancel_scope.cancel()
        except BaseException:  # cancelled (the launcher stops without a drain): stop as `stop` does
            with trio.CancelScope(shield=True):
                self.processes = processes
                await self.stop()
            raise
        if not self.stopping:  # else `stop` is ending them in order
            await _kill(processes)
        return self._why

    async def _exited(self, rank: int, process: trio.Process) -> None:
        code = await process.wait()
        who = "the engine's process" if self.ranks == 1 else f"rank {rank}"
        self.lose(f"{who} (pid {process.pid}) exited ({exit_status(code)})")


async def _kill(processes: list[trio.Process]) -> None:
    for process in processes:
        if process.returncode is None:
            process.kill()
    for process in processes:
        await process.wait()


def restart_delay(losses: list[float], now: float) -> float:
    """Seconds to wait before starting again, given the times of the losses so far (the last one now)."""
    in_a_row = sum(1 for at in losses if now - at < LOSS_WINDOW_S)
    return 0.0 if in_a_row <= 1 else min(MAX_RESTART_DELAY_S, RESTART_DELAY_S * 2 ** (in_a_row - 2))


def free_ports(count: int) -> list[int]:
    """`count` loopback ports free now (bound together, so distinct; closed before the ranks bind them)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def exit_status(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
