"""Dynamic children: start_child, terminate_child, and thousands of temporary sessions."""

from __future__ import annotations

import gc
import math

import pytest
import trio

from mlx_trio.supervision import ChildSpec, Restart, Supervisor
from mlx_trio.supervision.child import Child
from tests.supervision.supervision_helpers import Worker, recording


def live_child_records() -> int:
    """Count the child records still reachable in this process."""
    gc.collect()
    return sum(isinstance(obj, Child) for obj in gc.get_objects())


async def test_start_child_appends_and_returns_the_handle(autojump_clock: trio.abc.Clock) -> None:
    """A dynamic child starts last in order, returns its handle, and stops first."""
    log: list[str] = []
    sup = Supervisor("sessions", [recording("a", log)])
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        handle = await sup.start_child(recording("b", log))
        assert isinstance(handle, Worker) and sup.handle("b") is handle
        await sup.stop()
    assert log == ["start a", "start b", "stop b", "stop a"]


async def test_start_child_refuses_a_live_duplicate_id(autojump_clock: trio.abc.Clock) -> None:
    """Starting a second child with the id of a live one raises ValueError and starts nothing."""
    log: list[str] = []
    sup = Supervisor("sessions", [recording("a", log)])
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        with pytest.raises(ValueError, match="already has a child 'a'"):
            await sup.start_child(recording("a", log))
        await sup.stop()
    assert log == ["start a", "stop a"]


async def test_start_child_raises_the_start_failure_and_keeps_nothing(autojump_clock: trio.abc.Clock) -> None:
    """A dynamic child that fails to start raises from start_child and is not kept or retried."""
    log: list[str] = []
    sup = Supervisor("sessions")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        with pytest.raises(RuntimeError, match="s1 cannot start"):
            await sup.start_child(recording("s1", log, fail_next_start={"s1"}))
        assert sup.status()["children"] == [] and sup.status()["restarts"] == 0
        await sup.stop()
    assert log == ["start-failed s1"]


async def test_start_child_needs_a_running_supervisor() -> None:
    """start_child before run raises RuntimeError; terminate_child is then a no-op."""
    sup = Supervisor("sessions")
    with pytest.raises(RuntimeError, match="not running"):
        await sup.start_child(recording("s1", []))
    await sup.terminate_child("s1")
    assert sup.handle("s1") is None


async def test_terminate_child_stops_and_forgets_it(autojump_clock: trio.abc.Clock) -> None:
    """terminate_child stops a child without restarting it, and a second call does nothing."""
    log: list[str] = []
    sup = Supervisor("top", [recording(n, log) for n in "abc"])
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await sup.terminate_child("b")
        await sup.terminate_child("b")
        await trio.sleep(1)
        status = sup.status()
        await sup.stop()
    assert log == ["start a", "start b", "start c", "stop b", "stop c", "stop a"]
    assert [c["id"] for c in status["children"]] == ["a", "c"]
    assert status["restarts"] == 0


async def test_terminating_a_temporary_child_counts_it_as_ended(autojump_clock: trio.abc.Clock) -> None:
    """A terminated temporary child is counted in ended_temporary."""
    sup = Supervisor("sessions")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await sup.start_child(recording("s1", [], restart=Restart.TEMPORARY))
        await sup.terminate_child("s1")
        assert sup.status()["ended_temporary"] == 1
        await sup.stop()


async def test_a_thousand_temporary_sessions_leave_only_a_counter(autojump_clock: trio.abc.Clock) -> None:
    """1000 temporary children that finish leave no child behind, only ended_temporary == 1000."""

    async def session(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep(1)

    sup = Supervisor("sessions")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        before = live_child_records()
        for i in range(1000):
            await sup.start_child(ChildSpec(id=f"session-{i}", start=session, restart=Restart.TEMPORARY))
        assert len(sup.status()["children"]) == 1000
        await trio.sleep(2)
        status = sup.status()
        assert live_child_records() == before
        await sup.stop()
    assert status["children"] == [] and status["ended_temporary"] == 1000
    assert status["restarts"] == 0


async def test_a_child_that_returns_right_after_started_is_not_shown_running(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A transient child returning in the same step as started() ends up "stopped", with no handle."""

    async def brief(*, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started("handle")

    sup = Supervisor("top")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        assert await sup.start_child(ChildSpec(id="t", start=brief, restart=Restart.TRANSIENT)) == "handle"
        await trio.sleep(1)
        entry = sup.status()["children"][0]
        assert sup.handle("t") is None
        await sup.stop()
    assert (entry["state"], entry["uptime_s"], entry["restarts"]) == ("stopped", None, 0)


async def test_start_child_cancelled_as_the_child_reports_ready_leaves_it_cancellable(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A child whose starter is cancelled when it calls started() stays exposed to that cancellation.

    Were it shielded like a child that reached the supervisor's nursery, it could
    keep the cancelled start_child waiting forever.
    """
    caller = trio.CancelScope()
    deadlines: list[float] = []

    async def session(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        caller.cancel()
        task_status.started()
        deadlines.append(trio.current_effective_deadline())

    sup = Supervisor("sessions")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        with caller:
            await sup.start_child(ChildSpec(id="s", start=session, restart=Restart.TEMPORARY))
        assert caller.cancelled_caught
        assert deadlines == [-math.inf]
        assert sup.status()["children"] == []
        await sup.stop()
