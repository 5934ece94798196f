"""AdmissionActor alone: FIFO, the row cap, and the KV budget arithmetic."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from mlx_trio.actors.admission import AdmissionActor, KvBudgetExceeded, Limits
from mlx_trio.actors.lane import Lane
from mlx_trio.actors.messages import Generate
from mlx_trio.config import EngineConfig
from mlx_trio.params import SamplingParams
from mlx_trio.supervision.faults import Faults


_SESSIONS: list[object] = []  # the sessions' receiving ends stay open: nobody left


def _cmd(i: int, prompt: int = 10) -> Generate:
    send, recv = trio.open_memory_channel(10)
    _SESSIONS.append(recv)
    return Generate(f"r{i}", tuple(range(prompt)), SamplingParams(max_tokens=4), send)


async def _admission(nursery, *, budget: int, max_rows: int = 8, transient: int = 50):
    send, recv = trio.open_memory_channel[Generate](max_rows)

    async def limits() -> Limits:
        return Limits(project_bytes=lambda cmd: len(cmd.prompt_ids), transient_bytes=lambda cmd: transient,
                      budget_bytes=budget, max_rows=max_rows)

    lane = Lane(EngineConfig(batch=max_rows), Faults())
    lane.admission = actor = AdmissionActor(lane, send, limits)
    await nursery.start(actor.run)
    await trio.testing.wait_all_tasks_blocked()
    return actor, recv


async def test_prefill_transient_is_counted_once_not_per_row() -> None:
    """Three rows of 10 KV bytes with a 50-byte prefill transient fit a 100-byte budget together."""
    async with trio.open_nursery() as nursery:
        actor, admitted = await _admission(nursery, budget=100)
        for i in range(3):
            actor.submit_nowait(_cmd(i))
        await trio.testing.wait_all_tasks_blocked()
        assert actor.statistics().in_flight_rows == 3
        assert actor.statistics().reserved_bytes == 3 * 10 + 50
        nursery.cancel_scope.cancel()


async def test_fifo_head_of_line_waits_and_is_never_overtaken() -> None:
    """A head that does not fit blocks smaller requests behind it until bytes are released."""
    async with trio.open_nursery() as nursery:
        actor, admitted = await _admission(nursery, budget=100, transient=0)
        actor.submit_nowait(_cmd(0, prompt=60))
        actor.submit_nowait(_cmd(1, prompt=60))  # does not fit beside r0
        actor.submit_nowait(_cmd(2, prompt=5))  # would fit, but must not overtake r1
        await trio.testing.wait_all_tasks_blocked()
        assert [admitted.receive_nowait().request_id] == ["r0"]
        with pytest.raises(trio.WouldBlock):
            admitted.receive_nowait()
        actor.release("r0")
        await trio.testing.wait_all_tasks_blocked()
        assert [admitted.receive_nowait().request_id for _ in range(2)] == ["r1", "r2"]
        nursery.cancel_scope.cancel()


async def test_the_row_cap_holds_and_a_release_admits_the_next() -> None:
    """With max_rows 2 the third request waits for a slot."""
    async with trio.open_nursery() as nursery:
        actor, admitted = await _admission(nursery, budget=10**6, max_rows=2)
        for i in range(3):
            actor.submit_nowait(_cmd(i))
        await trio.testing.wait_all_tasks_blocked()
        assert actor.statistics().in_flight_rows == 2
        assert [admitted.receive_nowait().request_id for _ in range(2)] == ["r0", "r1"]
        actor.release("r1")
        await trio.testing.wait_all_tasks_blocked()
        assert actor.statistics().in_flight_rows == 2 and actor.statistics().admitted == 3
        nursery.cancel_scope.cancel()


async def test_never_fits_alone_is_refused_at_submit() -> None:
    """A request whose KV plus transient exceed the whole budget is a KvBudgetExceeded (400)."""
    async with trio.open_nursery() as nursery:
        actor, _ = await _admission(nursery, budget=100, transient=50)
        with pytest.raises(KvBudgetExceeded, match="--kv-budget"):
            actor.submit_nowait(_cmd(0, prompt=60))
        nursery.cancel_scope.cancel()
