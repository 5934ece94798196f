"""`FrontPool`: the launcher's part that runs the front processes and keeps them running.

It binds the public host:port itself (one listening socket every front
accepts from: the kernel gives each connection to whichever front is free,
and the port stays bound while a front restarts), then starts
`--api-server-count` front processes (front_process.py). A front that
exits unasked is started again (after `RESTART_DELAY_S`, counted in
`restarts`); its own clients' connections are cut, nobody else's. Each
front says on a pipe of its own when its `/health` first reads ok (`ready`:
every front has, so the "serving" line is true of whichever front a client
reaches). `drain`
asks every front to drain (SIGTERM) and waits for them; cancelling the pool
stops them (SIGTERM, then SIGKILL past the grace).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from mlx_trio.http.server.config import ServerConfig

if TYPE_CHECKING:  # at run time only in `drain`: it imports Quart, ~0.15 s before the launcher starts the engine
    from mlx_trio.http.server.drain import DrainReport

log = logging.getLogger("mlx_trio.link")

RESTART_DELAY_S = 0.2
BACKLOG = 1024


class FrontPool:
    """`config.api_server_count` front processes serving the engine linked at `link_path`; state in `workdir`."""

    def __init__(self, config: ServerConfig, link_path: str, workdir: Path) -> None:
        self.config = config
        self.link_path = link_path
        self._workdir = workdir
        self._socket: socket.socket | None = None
        self._processes: dict[int, trio.Process] = {}
        self._ready: set[int] = set()  # fronts whose running process said its engine link is healthy
        self._draining = False
        self.port: int | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def pids(self) -> list[int]:
        return sorted(p.pid for p in self._processes.values())

    @property
    def ready(self) -> bool:
        """Whether every front's running process has said that its `/health` reads ok."""
        return len(self._ready) == self.config.api_server_count

    async def run(self, *, task_status: trio.TaskStatus[FrontPool] = trio.TASK_STATUS_IGNORED) -> None:
        sock = self._socket = self._socket or self._listen()
        config_path = self._workdir / "server-config.pickle"
        fields = {**attrs.asdict(self.config, recurse=False),
                  "chat_template_args": dict(self.config.chat_template_args)}  # a MappingProxyType does not pickle
        config_path.write_bytes(pickle.dumps(fields))
        async with trio.open_nursery() as nursery:
            for index in range(self.config.api_server_count):
                nursery.start_soon(self._keep, index, sock.fileno(), config_path)
            task_status.started(self)

    def _listen(self) -> socket.socket:
        host, port = self.config.host, self.config.port
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        return sock

    async def _keep(self, index: int, fd: int, config_path: Path) -> None:
        """Run front `index`; start it again each time it exits unasked."""
        command = [sys.executable, "-m", "mlx_trio.processes.front_process", "--link", self.link_path,
                   "--config", str(config_path), "--listen-fd", str(fd), "--index", str(index),
                   "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
        while True:
            ready_read, ready_write = os.pipe()
            unclosed = [ready_write]  # the parent's copy of the write end, until the front holds its own
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._hear_ready, index, ready_read)
                    code = await run_process([*command, "--ready-fd", str(ready_write)],
                                             grace_s=self.config.graceful_timeout_s + 2.0,
                                             on_start=partial(self._started, index, unclosed),
                                             pass_fds=(fd, ready_write))
            finally:
                for end in unclosed:  # the process never started
                    os.close(end)
                self._ready.discard(index)
                process = self._processes.pop(index, None)
            if self._draining:
                return
            self.restarts += 1
            log.warning("front process %d (pid %s) exited with %s; starting it again", index,
                        process.pid if process is not None else "?", code)
            await trio.sleep(RESTART_DELAY_S)

    def _started(self, index: int, unclosed: list[int], process: trio.Process) -> None:
        self._processes[index] = process
        os.close(unclosed.pop())  # the front holds its own copy: its exit ends the pipe

    async def _hear_ready(self, index: int, ready_read: int) -> None:
        """Mark front `index` ready when its process writes to the pipe (an exit before that writes nothing)."""
        async with trio.lowlevel.FdStream(ready_read) as pipe:
            if await pipe.receive_some():
                self._ready.add(index)

    async def drain(self, timeout_s: float | None = None) -> DrainReport:
        """SIGTERM every front (each drains its own requests), then wait for them to exit."""
        from mlx_trio.http.server.drain import DrainReport  # noqa: PLC0415  (see the imports)

        timeout_s = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        self._draining = True
        start = time.monotonic()
        processes = list(self._processes.values())
        for process in processes:
            process.send_signal(signal.SIGTERM)
        with trio.move_on_after(timeout_s + self.config.graceful_timeout_s + 2.0):
            for process in processes:
                await process.wait()
        return DrainReport(in_flight_at_start=0, cut=0, elapsed_s=time.monotonic() - start)


async def run_process(command: list[str], *, grace_s: float, on_start: Callable[[trio.Process], object],
                      **options: Any) -> int:
    """Start `command` (`options` as `trio.lowlevel.open_process` takes them), hand the process to `on_start`,
    and return its exit status; cancelled, it stops the process first (`stop_process`)."""
    process = await trio.lowlevel.open_process(command, **options)
    on_start(process)
    try:
        return await process.wait()
    finally:
        if process.returncode is None:
            with trio.CancelScope(shield=True):
                await stop_process(process, grace_s)


async def stop_process(process: trio.Process, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s`."""
    process.send_signal(signal.SIGTERM)
    with trio.move_on_after(grace_s):
        await process.wait()
        return
    process.kill()
    await process.wait()


def link_socket_path(workdir: Path) -> str:
    """The engine link's socket in `workdir` (a private directory: the socket's only guard)."""
    os.chmod(workdir, 0o700)
    return str(workdir / "engine.sock")
