"""Rank 0's side of every lease job: broadcast it, run it, key what it returned.

`Leader.run_job` is the GPU lease's `run_job` hook (actors/gpu_lease.py): the lease calls it on
its thread for every job instead of calling the job itself, so nothing above the lease knows how
many ranks there are. The followers run the same job right after receiving it; the sharded model
layers meet in their `all_sum`s, so the ranks step in lockstep without any other handshake.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

from mlx_trio.engine.distributed import frames
from mlx_trio.engine.distributed.heartbeat import counters
from mlx_trio.engine.distributed.mirror import LeaderMirror
from mlx_trio.engine.distributed.world import World


class GroupLost(RuntimeError):
    """The group lost a follower (actors/rank_watch.py): no job runs on any rank any more."""


class Leader:
    """Broadcasts rank 0's lease jobs to the followers of `world` (size > 1)."""

    def __init__(self, world: World) -> None:
        assert world.distributed and world.leader and world.group is not None
        self.world = world
        self.mirror = LeaderMirror()
        self.jobs = 0
        self.broadcast_s = 0.0  # seconds spent in the broadcast collectives (the per-job cost of scale-out)
        self.bytes_sent = 0
        # Set once a follower is lost: every job fails at once instead of waiting on a collective
        # that never completes, so requests end with an error rather than hang.
        self.lost: str | None = None

    def run_job(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """``fn(*args)`` on every rank; returns (or raises) rank 0's outcome.

        Raises:
          NotMirrored: an argument is engine state no job returned (nothing was sent: the job did
            not run anywhere).
          RuntimeError: the backend lost a follower (mlx: "connection to a peer was lost"); from then
            on the group is lost (`lost`).
          GroupLost: a follower was lost before (nothing is sent).
        """
        if self.lost is not None:
            raise GroupLost(self.lost)
        payload = self.mirror.dumps((fn, args))
        start = time.perf_counter()
        message = pickle.dumps((self.mirror.next_key, self.mirror.take_dropped(), payload),
                               protocol=pickle.HIGHEST_PROTOCOL)
        assert self.world.group is not None
        try:
            frames.send(self.world.group, message)
        except Exception as exc:  # a broadcast is only collectives: it fails only when the group does
            self.lost = f"a follower was lost: {exc}"
            raise
        self.broadcast_s += time.perf_counter() - start
        self.jobs += 1
        self.bytes_sent += len(message)
        counters["jobs_run"] += 1
        try:
            result = fn(*args)
        except BaseException as exc:
            counters["jobs_failed"] += 1
            if backend_failed(exc):
                # Later collectives on this group may never return (measured on the ring backend:
                # the first raises, a later one waited for good): no job is sent over it again.
                self.lost = f"a follower was lost: {exc}"
            raise
        self.mirror.add_result(result)
        counters["objects"] = len(self.mirror)
        return result

    def stop_followers(self) -> None:
        """Tell the followers to leave their loop (the server is stopping). Any thread with MLX."""
        assert self.world.group is not None
        frames.send(self.world.group, frames.STOP)


# How MLX's distributed backends begin their errors ("[ring] connection to a peer was lost").
_BACKEND_PREFIXES = ("[ring]", "[mpi]", "[nccl]", "[jaccl]", "[distributed]")


def backend_failed(exc: BaseException) -> bool:
    """Whether `exc` is a distributed backend's failure (a lost peer), not the job's own error."""
    return isinstance(exc, RuntimeError) and str(exc).startswith(_BACKEND_PREFIXES)


_leader: Leader | None = None


def leader_for(world: World) -> Leader | None:
    """The process's one `Leader` (made on first use) when `world` is distributed and this is rank 0."""
    global _leader
    if not (world.distributed and world.leader):
        return None
    if _leader is None:
        _leader = Leader(world)
    return _leader
