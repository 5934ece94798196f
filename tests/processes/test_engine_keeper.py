"""`EngineKeeper` (mlx_trio/processes/engine_keeper.py) with stand-in processes: no MLX, no model, no ring.

What it must do when a rank is lost, fast: end the whole generation (every
other rank killed at once, nothing waited for) and start a new one on fresh
ports, as it restarts the one engine process; the front's resume does the rest
(tests/link/test_link.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import trio

from mlx_trio.config import EngineConfig
from mlx_trio.processes import engine_keeper
from mlx_trio.processes.engine_keeper import EngineKeeper

# A stand-in rank: writes "<pid>.json" (its rank, hostfile, flags) into MARKS, then waits. Rank 0 exits 0
# on SIGTERM (a stop); with FAIL set it writes the error file and exits 3 at once (a model that cannot load).
_RANK = r"""
import json, os, signal, sys, time
from pathlib import Path
marks = Path(os.environ["MARKS"])
flags = sys.argv[1:]
hostfile = os.environ.get("MLX_HOSTFILE")
(marks / f"{os.getpid()}.json").write_text(json.dumps({
    "rank": os.environ.get("MLX_RANK"), "flags": flags,
    "hosts": json.loads(Path(hostfile).read_text()) if hostfile else None}))
if os.environ.get("FAIL") and os.environ.get("MLX_RANK", "0") == "0":
    Path(flags[flags.index("--error-file") + 1]).write_text("the model failed to load: nope")
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(600)
"""


def _started(marks: Path) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in marks.glob("*.json") if p.stat().st_size}


def _keeper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranks: int, **env: str) -> tuple[EngineKeeper, Path]:
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("MARKS", str(marks))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(engine_keeper, "RESTART_DELAY_S", 0.0)
    monkeypatch.setattr(engine_keeper, "FOLLOWER_EXIT_S", 0.2)  # the stand-in followers do not hear a stop
    workdir = tmp_path / "work"
    workdir.mkdir()
    keeper = EngineKeeper(EngineConfig(), str(workdir / "engine.sock"), workdir, responses_store_bytes=1,
                          ranks=ranks, program=[sys.executable, "-c", _RANK])
    return keeper, marks


async def _until(condition, timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.01)


async def test_a_killed_rank_ends_its_generation_at_once_and_every_rank_starts_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL rank 1 of 2: rank 0 is killed (not asked: a collective on the dead peer may never return),
    and a new generation of both ranks starts on fresh ports, within a second of the kill."""
    keeper, marks = _keeper(tmp_path, monkeypatch, 2)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        keeper.ready_once = True
        await _until(lambda: len(_started(marks)) == 2)
        first = list(keeper.processes)
        hosts = next(iter(_started(marks).values()))["hosts"]
        assert sorted(m["rank"] for m in _started(marks).values()) == ["0", "1"]
        killed_at = time.monotonic()
        os.kill(first[1].pid, signal.SIGKILL)
        await _until(lambda: len(_started(marks)) == 4)
        assert time.monotonic() - killed_at < 1.0
        assert first[0].returncode == -signal.SIGKILL and keeper.generation == 2
        assert [why for _, why in keeper.lost] == [f"rank 1 (pid {first[1].pid}) exited (killed by signal 9)"]
        new = [m for pid, m in _started(marks).items() if pid not in {p.pid for p in first}]
        assert sorted(m["rank"] for m in new) == ["0", "1"] and new[0]["hosts"] != hosts
        second = list(keeper.processes)
        await keeper.stop()
        assert second[0].returncode == 0  # rank 0 was asked to stop (SIGTERM), not killed
        assert all(p.returncode is not None for p in second)
        nursery.cancel_scope.cancel()


async def test_a_lost_group_ends_its_generation_though_no_process_exited(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`lose` (rank 0 says its group is lost: a follower hung) kills both ranks and starts both again."""
    keeper, marks = _keeper(tmp_path, monkeypatch, 2)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        keeper.ready_once = True
        await _until(lambda: len(_started(marks)) == 2)
        first = list(keeper.processes)
        keeper.lose("rank 0 lost its group (a follower did not answer the heartbeat)")
        await _until(lambda: len(_started(marks)) == 4, 2.0)
        assert all(p.returncode == -signal.SIGKILL for p in first)
        assert [why for _, why in keeper.lost] == ["rank 0 lost its group (a follower did not answer the heartbeat)"]
        nursery.cancel_scope.cancel()
    assert all(p.returncode is not None for p in keeper.processes)  # cancelled: nothing left behind


async def test_the_one_engine_process_is_restarted_the_same_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ranks` 1: one process, no MLX_RANK and no hostfile; killed, it is started again."""
    keeper, marks = _keeper(tmp_path, monkeypatch, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        keeper.ready_once = True
        await _until(lambda: len(_started(marks)) == 1)
        assert next(iter(_started(marks).values()))["rank"] is None
        os.kill(keeper.processes[0].pid, signal.SIGKILL)
        await _until(lambda: len(_started(marks)) == 2)
        assert keeper.lost[0][1].startswith("the engine's process (pid ")
        nursery.cancel_scope.cancel()


async def test_a_group_that_never_became_ready_ends_the_keeper_with_the_engines_words(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keeper, marks = _keeper(tmp_path, monkeypatch, 2, FAIL="1")
    with trio.fail_after(10):
        await keeper.run()
    assert keeper.failed == "the model failed to load: nope" and keeper.generation == 1
    assert all(p.returncode is not None for p in keeper.processes)


async def test_the_launcher_ends_a_generation_whose_rank_0_reports_its_group_lost() -> None:
    """A hung follower exits nothing: the launcher reads rank 0's `group_lost` over its own link and ends it."""
    from types import SimpleNamespace

    from mlx_trio.processes.launcher import Launcher

    lost: list[str] = []
    watch = SimpleNamespace(group_lost=None)
    launcher = SimpleNamespace(watch=watch, keeper=SimpleNamespace(lose=lost.append))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(Launcher._watch_group, launcher)  # type: ignore[arg-type]
        await trio.sleep(0.2)
        assert lost == []
        watch.group_lost = "a follower did not answer the heartbeat within the 2 s collective timeout"
        await _until(lambda: lost, 1.0)
        nursery.cancel_scope.cancel()
    assert lost[0] == ("rank 0 lost its group (a follower did not answer the heartbeat within the 2 s collective "
                       "timeout)")


def test_a_first_loss_restarts_at_once_and_losses_in_a_row_back_off() -> None:
    from mlx_trio.processes.engine_keeper import MAX_RESTART_DELAY_S, RESTART_DELAY_S, restart_delay

    assert restart_delay([100.0], 100.0) == 0.0
    assert restart_delay([0.0, 100.0], 100.0) == 0.0  # the earlier one is long past
    assert restart_delay([90.0, 100.0], 100.0) == RESTART_DELAY_S
    assert restart_delay([80.0, 90.0, 100.0], 100.0) == 2 * RESTART_DELAY_S
    assert restart_delay([99.0 + i / 100 for i in range(40)], 100.0) == MAX_RESTART_DELAY_S


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_a_serving_launcher_has_loaded_no_mlx(tmp_path: Path) -> None:
    """The launcher's own link reads health and the model's name, never the output format (whose unpickling
    imports mlx-lm and MLX: 90 MB and seconds of its start on the 2-core box, before this)."""
    import subprocess

    from mlx_trio.testing.tiny_models import LLAMA, tiny_model

    process = subprocess.Popen([sys.executable, "-m", "mlx_trio.cli", "serve", "--model", str(tiny_model(LLAMA)),
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("mlx-trio: serving"):
                break
        maps = Path(f"/proc/{process.pid}/maps").read_text()
        assert "libmlx" not in maps and "mlx/core" not in maps
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
