""""serving" is printed once every front reaches the engine: a front whose first connection came before the
engine's socket existed retries a moment later, and a client that reached it meanwhile read "the engine process
is not reachable" from a server that had said it was serving (a CI failure of test_cli's SIGTERM test)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import trio

from mlx_trio.http.server.config import ServerConfig
from mlx_trio.processes import front_process
from mlx_trio.processes.front_pool import FrontPool
from mlx_trio.processes.launcher import Launcher

WAIT_S = 5.0  # only reached when a test fails


class _Engine:
    """Stands in for RemoteEngine's health: unreachable until `up` is set."""

    def __init__(self) -> None:
        self.up = False

    def health(self) -> tuple[bool, str]:
        return (True, "ok") if self.up else (False, "the engine process is not reachable")


async def test_a_front_says_ready_only_once_its_link_reads_healthy() -> None:
    engine = _Engine()
    read_end, write_end = os.pipe()
    async with trio.lowlevel.FdStream(read_end) as pipe, trio.open_nursery() as nursery:
        nursery.start_soon(front_process._say_ready, engine, write_end)
        with trio.move_on_after(0.3):
            await pipe.receive_some()
            raise AssertionError("ready before the link was healthy")
        engine.up = True
        with trio.fail_after(WAIT_S):
            assert await pipe.receive_some() == b"ready"
            assert await pipe.receive_some() == b""  # and the front closed its end


async def test_the_pool_is_ready_when_every_front_wrote_and_not_on_an_exit_without_a_word(tmp_path: Path) -> None:
    pool = FrontPool(ServerConfig(api_server_count=2), str(tmp_path / "engine.sock"), tmp_path)
    pipes = [os.pipe(), os.pipe()]
    async with trio.open_nursery() as nursery:
        for index, (read_end, _) in enumerate(pipes):
            nursery.start_soon(pool._hear_ready, index, read_end)
        os.write(pipes[0][1], b"ready")
        os.close(pipes[0][1])
        os.close(pipes[1][1])  # front 1 exited before its link was up
    assert not pool.ready
    read_end, write_end = os.pipe()  # front 1 started again, and this one got there
    os.write(write_end, b"ready")
    os.close(write_end)
    await pool._hear_ready(1, read_end)
    assert pool.ready


async def test_the_launcher_waits_for_the_fronts_after_the_engine() -> None:
    launcher = Launcher.__new__(Launcher)
    engine = _Engine()
    engine.up = True
    launcher.watch = SimpleNamespace(health=engine.health, model_id="tiny")
    launcher.pool = SimpleNamespace(ready=False, url="http://127.0.0.1:1")
    launcher.keeper = SimpleNamespace(failed=None, ready_once=False)
    launcher._label = "tiny"
    async with trio.open_nursery() as nursery:
        done = trio.Event()

        async def wait() -> None:
            await launcher._wait_ready()
            done.set()

        nursery.start_soon(wait)
        await trio.sleep(0.3)
        assert not done.is_set() and launcher.keeper.ready_once  # the engine is up, a front is not yet
        launcher.pool.ready = True
        with trio.fail_after(WAIT_S):
            await done.wait()
