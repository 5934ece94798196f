"""A follower rank's whole life: receive rank 0's lease jobs and run them, until told to stop.

No Trio, no HTTP, no actors: a follower runs only what rank 0's lease sends, in order, on its
own mirrors of the engine objects (mirror.py). A job's result stays here (only rank 0's results
reach Trio); a job that raises raised on rank 0 too, so it is logged and the loop goes on. A
follower whose keys no longer match rank 0's stops: its jobs would compute something else.
"""

from __future__ import annotations

import logging
import pickle

from mlx_trio.engine.distributed import frames
from mlx_trio.engine.distributed.heartbeat import counters
from mlx_trio.engine.distributed.mirror import FollowerMirror
from mlx_trio.engine.distributed.world import World
from mlx_trio.engine.lease_thread import prepare_thread, release_thread_streams

log = logging.getLogger(__name__)


def serve_follower(world: World) -> None:
    """Run rank 0's jobs until it sends STOP.

    Raises:
      Desynchronised: this rank's objects no longer match rank 0's.
      RuntimeError: the backend lost rank 0 (it died).
    """
    assert world.distributed and not world.leader and world.group is not None
    prepare_thread()
    mirror = FollowerMirror()
    try:
        while (message := frames.receive(world.group)) != frames.STOP:
            leader_next, dropped, payload = pickle.loads(message)
            mirror.drop(dropped)
            mirror.check(leader_next)
            fn, args = mirror.loads(payload)
            try:
                result = fn(*args)
            except Exception:  # noqa: BLE001 - it failed on rank 0 too, which tells its caller
                counters["jobs_failed"] += 1
                log.debug("rank %d: job %s failed", world.rank, getattr(fn, "__qualname__", fn), exc_info=True)
                continue
            finally:
                counters["jobs_run"] += 1
            mirror.add_result(result)
            counters["objects"] = len(mirror)
    finally:
        release_thread_streams()
    log.info("rank %d: rank 0 stopped the group", world.rank)
