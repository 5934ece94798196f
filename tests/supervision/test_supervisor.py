"""Strategies, restart types, restart intensity, nesting and the shutdown ladder."""

from __future__ import annotations

import logging

import pytest
import trio

from mlx_trio.errors import EngineFailure
from mlx_trio.supervision import ChildSpec, Restart, Strategy, Supervisor, SupervisorGaveUp
from tests.supervision.supervision_helpers import Worker, recording

START_ABC = ["start a", "start b", "start c"]
STOP_CBA = ["stop c", "stop b", "stop a"]


def workers(log: list[str], names: str = "abc", **kwargs: Restart) -> list[ChildSpec]:
    """Return recording specs named by the letters of `names`; kwargs set restart types."""
    return [recording(name, log, restart=kwargs.get(name, Restart.PERMANENT)) for name in names]


def worker(sup: Supervisor, name: str) -> Worker:
    """Return the running worker `name`, failing the test if it is not running."""
    handle = sup.handle(name)
    assert isinstance(handle, Worker)
    return handle


async def settle() -> None:
    """Let the supervisors act on what the test did (virtual time, autojump clock)."""
    await trio.sleep(0.01)


@pytest.mark.parametrize(
    ("strategy", "after_crash"),
    [
        (Strategy.ONE_FOR_ONE, ["crash b", "start b"]),
        (Strategy.ONE_FOR_ALL, ["crash b", "stop c", "stop a", "start a", "start b", "start c"]),
        (Strategy.REST_FOR_ONE, ["crash b", "stop c", "start b", "start c"]),
    ],
    ids=["one_for_one", "one_for_all", "rest_for_one"],
)
async def test_strategy_restarts_exactly_its_children(
    strategy: Strategy, after_crash: list[str], autojump_clock: trio.abc.Clock
) -> None:
    """Each strategy restarts exactly its children, in order, and stops in reverse order."""
    log: list[str] = []
    sup = Supervisor("top", workers(log), strategy=strategy)
    async with trio.open_nursery() as nursery:
        assert await nursery.start(sup.run) is sup
        worker(sup, "b").crash()
        await settle()
        await sup.stop()
    assert log == START_ABC + after_crash + STOP_CBA


async def test_rest_for_one_with_the_last_child_restarts_only_it(autojump_clock: trio.abc.Clock) -> None:
    """rest_for_one restarts nothing but the last child when the last child crashes."""
    log: list[str] = []
    sup = Supervisor("top", workers(log), strategy=Strategy.REST_FOR_ONE)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        worker(sup, "c").crash()
        await settle()
        nursery.cancel_scope.cancel()
    assert log == [*START_ABC, "crash c", "start c", *STOP_CBA]


async def test_cancelling_the_supervisor_stops_children_in_reverse_order(autojump_clock: trio.abc.Clock) -> None:
    """Cancelling the task running the supervisor stops its children one by one, last first."""
    log: list[str] = []
    sup = Supervisor("top", workers(log, "abcde"))
    with trio.move_on_after(1):
        await sup.run()
    assert log == [f"start {n}" for n in "abcde"] + [f"stop {n}" for n in "edcba"]
    assert sup.status()["state"] == "stopped"


async def test_transient_child_is_restarted_only_after_an_exception(autojump_clock: trio.abc.Clock) -> None:
    """A transient child that raises restarts; one that returns stays stopped and listed."""
    log: list[str] = []
    sup = Supervisor("top", workers(log, "ab", b=Restart.TRANSIENT))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        worker(sup, "b").crash()
        await settle()
        worker(sup, "b").finish()
        await settle()
        states = {c["id"]: c["state"] for c in sup.status()["children"]}
        assert sup.handle("b") is None
        await sup.stop()
    assert log == ["start a", "start b", "crash b", "start b", "return b", "stop a"]
    assert states == {"a": "running", "b": "stopped"}


async def test_temporary_child_is_never_restarted_and_is_forgotten(autojump_clock: trio.abc.Clock) -> None:
    """A temporary child that raises is not restarted and disappears from the status tree."""
    log: list[str] = []
    sup = Supervisor("top", workers(log, "ab", a=Restart.TEMPORARY))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        worker(sup, "a").crash()
        await settle()
        status = sup.status()
        await sup.stop()
    assert log == ["start a", "start b", "crash a", "stop b"]
    assert [c["id"] for c in status["children"]] == ["b"]
    assert (status["ended_temporary"], status["restarts"]) == (1, 0)


async def test_one_for_all_restarts_transient_siblings_and_drops_temporary_ones(
    autojump_clock: trio.abc.Clock,
) -> None:
    """one_for_all restarts a stopped transient sibling but drops a temporary sibling (OTP)."""
    log: list[str] = []
    sup = Supervisor("top", workers(log, b=Restart.TRANSIENT, c=Restart.TEMPORARY), strategy=Strategy.ONE_FOR_ALL)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        worker(sup, "b").finish()
        await settle()
        worker(sup, "a").crash()
        await settle()
        ids = [c["id"] for c in sup.status()["children"]]
        await sup.stop()
    assert log == [*START_ABC, "return b", "crash a", "stop c", "start a", "start b", "stop b", "stop a"]
    assert ids == ["a", "b"]


async def test_a_permanent_child_that_returns_is_restarted(autojump_clock: trio.abc.Clock) -> None:
    """A permanent child is restarted even when it returns normally."""
    log: list[str] = []
    sup = Supervisor("top", workers(log, "a"))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        worker(sup, "a").finish()
        await settle()
        assert sup.status()["children"][0]["restarts"] == 1
        await sup.stop()
    assert log == ["start a", "return a", "start a", "stop a"]


async def test_too_many_restarts_stop_everything_and_raise(autojump_clock: trio.abc.Clock) -> None:
    """Exceeding the intensity stops all children and raises SupervisorGaveUp naming the child and its error."""
    log: list[str] = []
    sup = Supervisor("top", workers(log), max_restarts=2, period_s=10.0)

    async def crash_b_three_times() -> None:
        for _ in range(3):
            await settle()
            worker(sup, "b").crash(KeyError("gone"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(crash_b_three_times)
        with pytest.raises(SupervisorGaveUp) as caught:
            await sup.run()
    assert isinstance(caught.value, EngineFailure)
    assert isinstance(caught.value.__cause__, KeyError)
    assert "'b'" in str(caught.value) and caught.value.child_id == "b"
    assert log == [*START_ABC] + ["crash b", "start b"] * 2 + ["crash b", "stop c", "stop a"]
    assert sup.status()["state"] == "failed"


async def test_restarts_spread_over_more_than_period_s_are_tolerated(autojump_clock: trio.abc.Clock) -> None:
    """Restarts older than period_s no longer count toward the intensity."""
    log: list[str] = []
    sup = Supervisor("top", workers(log, "a"), max_restarts=1, period_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        for _ in range(5):
            worker(sup, "a").crash()
            await trio.sleep(1.5)
        assert sup.status()["restarts"] == 5
        await sup.stop()
    assert log == ["start a"] + ["crash a", "start a"] * 5 + ["stop a"]


async def test_start_failure_at_startup_stops_started_children_and_raises(autojump_clock: trio.abc.Clock) -> None:
    """A child failing to start at startup stops the started ones in reverse and raises from run."""
    log: list[str] = []
    specs = [recording(n, log, fail_next_start={"c"}) for n in "abcd"]
    sup = Supervisor("top", specs)
    async with trio.open_nursery() as nursery:
        with pytest.raises(RuntimeError, match="c cannot start"):
            await nursery.start(sup.run)
    assert log == ["start a", "start b", "start-failed c", "stop b", "stop a"]
    assert sup.status()["state"] == "failed"


async def test_start_failure_during_restart_counts_as_a_crash(autojump_clock: trio.abc.Clock) -> None:
    """A restart whose start fails counts toward the intensity and is retried."""
    log: list[str] = []
    fail = {"b"}
    sup = Supervisor("top", [recording(n, log, fail_next_start=fail) for n in "abc"], max_restarts=2)
    fail.clear()
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        fail.add("b")
        worker(sup, "b").crash()
        await settle()
        status = sup.status()
        await sup.stop()
    assert log == [*START_ABC, "crash b", "start-failed b", "start b", *STOP_CBA]
    assert status["restarts"] == 2
    assert status["children"][1]["restarts"] == 2
    assert status["children"][1]["last_error"] == "RuntimeError: b cannot start"


async def test_parent_restarts_a_nested_supervisor_that_gave_up(autojump_clock: trio.abc.Clock) -> None:
    """A nested supervisor that gives up is restarted by its parent with fresh children."""
    log: list[str] = []
    inner = Supervisor("inner", workers(log, "xy"), max_restarts=0)
    outer = Supervisor("outer", [recording("a", log), inner.as_child(), recording("c", log)])
    async with trio.open_nursery() as nursery:
        await nursery.start(outer.run)
        assert outer.handle("inner") is inner
        old_x = worker(inner, "x")
        old_x.crash()
        await settle()
        assert worker(inner, "x") is not old_x
        status = outer.status()
        await outer.stop()
    assert log == ["start a", "start x", "start y", "start c", "crash x", "stop y", "start x", "start y"] + [
        "stop c",
        "stop y",
        "stop x",
        "stop a",
    ]
    nested = status["children"][1]
    assert (nested["id"], nested["state"], nested["restarts"], nested["restarts_performed"]) == (
        "inner",
        "running",
        1,
        0,
    )
    assert nested["last_error"].startswith("SupervisorGaveUp: supervisor 'inner' gave up")
    assert [c["id"] for c in nested["children"]] == ["x", "y"]


async def test_parent_gives_up_when_its_own_intensity_is_exceeded(autojump_clock: trio.abc.Clock) -> None:
    """Repeated escalations from a nested supervisor make the parent give up in turn."""
    log: list[str] = []
    inner = Supervisor("inner", workers(log, "x"), max_restarts=0)
    outer = Supervisor("outer", [recording("a", log), inner.as_child()], max_restarts=1)

    async def crash_x_twice() -> None:
        for _ in range(2):
            await settle()
            worker(inner, "x").crash()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(crash_x_twice)
        with pytest.raises(SupervisorGaveUp) as caught:
            await outer.run()
    assert caught.value.supervisor_id == "outer" and caught.value.child_id == "inner"
    assert isinstance(caught.value.__cause__, SupervisorGaveUp)
    assert isinstance(caught.value.__cause__.__cause__, ValueError)
    assert log == ["start a", "start x", "crash x", "start x", "crash x", "stop a"]


async def test_a_slow_child_delays_the_others_by_at_most_its_shutdown_s(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A child that ignores cancellation holds up the reverse-order shutdown by only shutdown_s."""
    events: list[tuple[str, float]] = []

    def timed(name: str, ignore_cancel_s: float = 0.0, shutdown_s: float = 5.0) -> ChildSpec:
        async def start(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await trio.sleep(ignore_cancel_s)
                events.append((f"stopped {name}", trio.current_time()))

        return ChildSpec(id=name, start=start, shutdown_s=shutdown_s)

    sup = Supervisor("top", [timed("a"), timed("b", ignore_cancel_s=10.0, shutdown_s=1.0), timed("c")])
    with caplog.at_level(logging.WARNING, logger="mlx_trio.supervision"):
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            t0 = trio.current_time()
            await sup.stop()
            stop_returned = trio.current_time() - t0
    assert [(name, t - t0) for name, t in events] == [("stopped c", 0.0), ("stopped a", 1.0), ("stopped b", 10.0)]
    assert stop_returned == 10.0
    assert any("'b' still running 1.0 s after it was cancelled" in r.getMessage() for r in caplog.records)
