"""The status tree: states, counters, errors, nesting and actor statistics."""

from __future__ import annotations

import json

import trio

from mlx_trio.supervision import ChildSpec, Restart, Strategy, Supervisor
from tests.supervision.supervision_helpers import Worker, recording


async def test_status_before_and_after_running() -> None:
    """A supervisor that never ran, and one that stopped, report state "stopped" and no children."""
    sup = Supervisor("top", [recording("a", [])])
    assert sup.status()["state"] == "stopped" and sup.status()["children"] == []
    with trio.move_on_after(0.01):
        await sup.run()
    assert sup.status()["state"] == "stopped"
    assert sup.status()["children"][0]["state"] == "stopped"


async def test_status_reports_the_live_tree(autojump_clock: trio.abc.Clock) -> None:
    """status() shows states, restarts, last errors, uptimes, nested supervisors and stats."""
    log: list[str] = []
    inner = Supervisor("engine", [recording("decode-step", log, kind="decode-step")], strategy=Strategy.ONE_FOR_ALL)
    sup = Supervisor(
        "root",
        [recording("lease", log, kind="gpu-lease"), inner.as_child(), recording("s", log, restart=Restart.TRANSIENT)],
        max_restarts=5,
        period_s=30.0,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await trio.sleep(2)
        lease = sup.handle("lease")
        assert isinstance(lease, Worker)
        lease.crash(OSError("device lost"))
        await trio.sleep(3)
        status = sup.status()
        await sup.stop()
    json.dumps(status)  # the tree is plain data
    children = status.pop("children")
    assert status == {
        "id": "root",
        "kind": "supervisor",
        "strategy": "one_for_one",
        "state": "running",
        "restarts": 1,
        "max_restarts": 5,
        "period_s": 30.0,
        "uptime_s": 5.0,
        "ended_temporary": 0,
    }
    lease_entry, engine_entry, session_entry = children
    assert lease_entry == {
        "id": "lease",
        "kind": "gpu-lease",
        "restart": "permanent",
        "state": "running",
        "restarts": 1,
        "last_error": "OSError: device lost",
        "uptime_s": 3.0,
        "stats": {"mailbox_depth": 0, "served": 7},
        "mailbox_depth": 0,
    }
    assert (engine_entry["kind"], engine_entry["strategy"], engine_entry["uptime_s"]) == ("supervisor", "one_for_all", 5.0)
    assert [(c["id"], c["kind"], c["state"]) for c in engine_entry["children"]] == [
        ("decode-step", "decode-step", "running")
    ]
    assert (session_entry["restart"], session_entry["restarts"], session_entry["last_error"]) == ("transient", 0, None)


async def test_status_shows_stopping_while_a_child_is_slow_to_stop(autojump_clock: trio.abc.Clock) -> None:
    """A child still inside its shutdown ladder is reported as "stopping", its supervisor too."""

    async def stubborn(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(2)

    sup = Supervisor("top", [ChildSpec(id="slow", start=stubborn)])
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        nursery.start_soon(sup.stop)
        await trio.sleep(1)
        status = sup.status()
    assert status["state"] == "stopping"
    assert status["children"][0]["state"] == "stopping"
    assert sup.status()["state"] == "stopped"


async def test_broken_statistics_do_not_break_status(autojump_clock: trio.abc.Clock) -> None:
    """A handle whose statistics() raises is reported with stats_error instead of failing status()."""

    class Broken:
        def statistics(self) -> dict[str, int]:
            raise ZeroDivisionError("no stats")

    async def start(*, task_status: trio.TaskStatus[Broken] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(Broken())
        await trio.sleep_forever()

    sup = Supervisor("top", [ChildSpec(id="broken", start=start)])
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        entry = sup.status()["children"][0]
        await sup.stop()
    assert entry["stats_error"] == "ZeroDivisionError: no stats" and "stats" not in entry


async def test_liveness_says_what_status_says_of_the_top_level(autojump_clock: trio.abc.Clock) -> None:
    """liveness(): the supervisor's state and its children not running, as status() has them, without the tree."""
    log: list[str] = []
    sup = Supervisor("root", [recording("a", log), recording("b", log, restart=Restart.TEMPORARY)])
    assert sup.liveness() == ("stopped", [])

    def from_status() -> tuple[str, list[str]]:
        status = sup.status()
        return status["state"], [c["id"] for c in status["children"] if c["state"] != "running"]

    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        assert sup.liveness() == from_status() == ("running", [])
        worker = sup.handle("b")
        assert isinstance(worker, Worker)
        worker.crash(OSError("gone"))  # temporary: not restarted
        await trio.sleep(1)
        assert sup.liveness() == from_status()
        await sup.stop()
    assert sup.liveness() == from_status()
