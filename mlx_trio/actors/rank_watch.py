"""Rank 0's watch over its followers: a heartbeat collective with a deadline (docs/scale-out.md).

Every `heartbeat_s` this actor runs `heartbeat.beat` through the lease, which sends it to every
rank like any job; it returns once every rank joined its `all_gather`. A beat that has not
returned within `collective_timeout_s` (a follower hung: its collective never comes), or that
raised (a follower died: the backend lost its connection), marks the group lost: `/health`
answers 503 with the reason and `/v1/status` shows each rank's last heartbeat. The lease thread
stays wherever the missing rank left it (an MLX collective has no timeout): the watch abandons
it and makes every later job fail at once, so requests end with an error instead of hanging,
and stops beating. A group is never re-formed inside a running rank (MLX keeps a process's first
group for good: mlx_trio/processes/engine_keeper.py says why): rank 0 stays up saying so. Under
mlx-trio's own launcher (`--tensor-parallel N`), which reads `group_lost` over its link, every rank
is then ended and started again, and the fronts resume the streams on the new group; under
mlx.launch it stays so until it is restarted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from mlx_trio.actors.lane import Lane
from mlx_trio.engine.distributed.heartbeat import beat
from mlx_trio.engine.distributed.leader import GroupLost, leader_for
from mlx_trio.engine.distributed.world import World

log = logging.getLogger(__name__)


class RankWatch:
    """Heartbeats rank 0's followers; `lost` says why the group is gone (None while it answers)."""

    def __init__(self, lane: Lane, world: World, *, heartbeat_s: float, deadline_s: float) -> None:
        self._lane = lane
        self._world = world
        self._heartbeat_s = heartbeat_s
        self._deadline_s = deadline_s
        self.lost: str | None = None
        self._ranks: list[dict[str, Any]] = []
        self._last_beat: float | None = None  # time.time() of the last answered beat
        self.beats = 0

    def status(self) -> list[dict[str, Any]]:
        """Each rank: id, host, backend, state (up / lost / starting), last heartbeat (epoch s), jobs run."""
        state = "lost" if self.lost else ("up" if self._ranks else "starting")
        known = {r["rank"]: r for r in self._ranks}
        return [{"id": rank, "host": known.get(rank, {}).get("host"), "backend": self._world.backend,
                 "state": "up" if rank == 0 else state,  # rank 0 is the one answering
                 "last_heartbeat": self._last_beat if rank in known else None,
                 "jobs_run": known.get(rank, {}).get("jobs_run")} for rank in range(self._world.size)]

    async def run(self, *, task_status: trio.TaskStatus[RankWatch] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        await self._beat()

    async def _beat(self) -> None:
        await self._lane.wait_model()
        while self.lost is None:
            lease = self._lane.lease
            assert lease is not None
            sent = time.monotonic()
            try:
                with trio.move_on_after(self._deadline_s) as deadline:
                    ranks = await lease.run(beat, abandon_on_cancel=True)
            except GroupLost as exc:  # the lease hook saw the backend fail first
                self._lose(str(exc))
                break
            except Exception as exc:  # noqa: BLE001 - a lost peer is reported, never raised into the tree
                self._lose(f"a follower was lost: {exc}")
                break
            if deadline.cancelled_caught:
                self._lose(f"a follower did not answer the heartbeat within the {self._deadline_s:g} s "
                           "collective timeout (hung or unreachable)")
                break
            self._ranks, self._last_beat = ranks, time.time()
            self.beats += 1
            await trio.sleep(max(0.0, self._heartbeat_s - (time.monotonic() - sent)))
        await trio.sleep_forever()  # lost for good: keep reporting it (a return would be a crash to restart)

    def _lose(self, reason: str) -> None:
        """From now on every lease job fails at once (`GroupLost`), and the job stuck in a collective
        releases its waiters (`abandon`): requests end with an error instead of hanging. Once only."""
        if self.lost is not None:
            return
        self.lost = reason
        log.error("scale-out: %s; the ranks must be restarted", reason)
        leader = leader_for(self._world)
        if leader is not None:
            leader.lost = reason
        if self._lane.lease is not None:
            self._lane.lease.abandon()
