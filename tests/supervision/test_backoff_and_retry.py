"""Restart backoff (`Backoff`) and a supervisor that outlives its giving up (`Retrying`)."""

from __future__ import annotations

import pytest
import trio

from mlx_trio.supervision import Backoff, Retrying, Supervisor
from tests.supervision.supervision_helpers import Worker, recording


def test_backoff_waits_only_for_a_streak_of_quick_crashes() -> None:
    """First crash of a streak: at once; then first_s doubling to max_s; a long run ends the streak."""
    backoff = Backoff(first_s=0.01, max_s=0.05, quick_s=1.0)
    streak, delays = 0, []
    for _ in range(5):
        streak = backoff.streak(streak, uptime_s=0.2)
        delays.append(backoff.delay_s(streak))
    assert delays == [0.0, 0.01, 0.02, 0.04, 0.05]
    assert backoff.streak(streak, uptime_s=1.0) == 1 and backoff.delay_s(1) == 0.0
    assert Backoff().delay_s(10) == 0.0


async def _crash_when_started(sup: Supervisor, name: str, times: int) -> list[float]:
    """Crash child `name` as soon as each incarnation runs, `times` times; the Trio times of the crashes."""
    crashes = []
    for _ in range(times):
        while not isinstance(handle := sup.handle(name), Worker):
            await trio.sleep(0.001)
        crashes.append(trio.current_time())
        handle.crash()
        await trio.sleep(0.001)
    return crashes


async def test_a_supervisor_spaces_the_restarts_of_a_crash_loop(autojump_clock: trio.abc.Clock) -> None:
    """Crashing right after each start: the restarts come later and later (virtual time)."""
    log: list[str] = []
    sup = Supervisor("top", [recording("a", log)], max_restarts=100, period_s=10.0,
                     backoff=Backoff(first_s=0.5, max_s=2.0, quick_s=5.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        crashes = await _crash_when_started(sup, "a", 5)
        await sup.stop()
    gaps = [round(b - a, 1) for a, b in zip(crashes, crashes[1:])]
    assert gaps == [0.0, 0.5, 1.0, 2.0]


async def test_retrying_keeps_the_parent_running_and_starts_the_supervisor_again(
        autojump_clock: trio.abc.Clock) -> None:
    """Give-up: `down` says why and when; the parent sees no crash; after the wait the children run again."""
    log: list[str] = []
    inner = Supervisor("engine", [recording("a", log)], max_restarts=0, period_s=10.0)
    retrying = Retrying(inner, first_s=4.0, max_s=8.0, stable_s=100.0)
    outer = Supervisor("root", [retrying.as_child()], max_restarts=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(outer.run)
        assert outer.handle("engine") is inner
        given_up = []
        for expected_wait in (4.0, 8.0, 8.0):
            await _crash_when_started(inner, "a", 1)
            await trio.sleep(0.01)
            assert retrying.down is not None and "gave up" in retrying.down.reason
            given_up.append(round(retrying.down.retry_in_s(), 1))
            assert outer.status()["state"] == "running" and outer.status()["restarts"] == 0
        await trio.sleep(9)
        assert retrying.down is None and retrying.retries == 3 and isinstance(inner.handle("a"), Worker)
        await outer.stop()
    assert given_up == [4.0, 8.0, 8.0]
    assert log == ["start a", "crash a"] * 3 + ["start a", "stop a"]


async def test_retrying_raises_the_first_start_failure() -> None:
    """Nothing has worked yet: a failed first start is the caller's error, not an outage to retry."""
    log: list[str] = []
    inner = Supervisor("engine", [recording("a", log, fail_next_start={"a"})])
    with pytest.raises(RuntimeError, match="a cannot start"):
        await Retrying(inner).run()
