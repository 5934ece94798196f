"""Each rank's state in one collective: the heartbeat rank 0 sends as a lease job.

`beat` runs on every rank (rank 0's lease broadcasts it like any job); each rank contributes a
small JSON frame of its own state to one `all_gather`, so rank 0 learns that every follower is
alive and in step, and what it has done. A beat that does not return within its deadline means
a follower is gone or hung (actors/rank_watch.py).

Fault injection for drills and tests: a follower started with `MLX_TRIO_FOLLOWER_HANG_AT_BEAT=K`
blocks forever in its K-th beat (1-based) instead of joining it: a hung follower.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_trio.engine.distributed.world import current_world

BEAT_BYTES = 256
HANG_AT_BEAT_ENV = "MLX_TRIO_FOLLOWER_HANG_AT_BEAT"
_beats = 0
# Updated by the rank's job loop: rank 0's Leader or a follower's loop (follower.py).
counters: dict[str, int] = {"jobs_run": 0, "jobs_failed": 0, "objects": 0}


def beat() -> list[dict[str, Any]]:
    """Every rank's state, in rank order: rank, host, backend, jobs_run, jobs_failed, objects, at (epoch s)."""
    global _beats
    _beats += 1
    world = current_world()
    if not world.leader and _beats == int(os.environ.get(HANG_AT_BEAT_ENV, "0")):
        threading.Event().wait()  # the injected hang: never joins this collective
    mine = json.dumps({"rank": world.rank, "host": world.host, "backend": world.backend, **counters,
                       "at": time.time()}).encode()[:BEAT_BYTES]
    frame = np.zeros(BEAT_BYTES, dtype=np.uint8)
    frame[:len(mine)] = np.frombuffer(mine, dtype=np.uint8)
    gathered = mx.distributed.all_gather(mx.array(frame), group=world.group)
    mx.eval(gathered)
    raw = bytes(memoryview(gathered))
    return [json.loads(raw[i:i + BEAT_BYTES].rstrip(b"\0")) for i in range(0, len(raw), BEAT_BYTES)]
