"""How one `mlx-trio serve` process takes its place in an mlx.distributed group (docs/scale-out.md).

Three cases, decided before anything binds a port or loads a model:
* not launched, `--tensor-parallel 1`: one engine process, nothing changes;
* not launched, `--tensor-parallel N` (or `--pipeline-parallel N`): the launcher (mlx_trio/processes/)
  keeps N local rank processes (the ring backend over loopback) as the engine its front processes
  serve, and starts them again whenever the group is lost, as it restarts a crashed engine process;
* launched by `mlx.launch` (any backend, any hosts): join the group; rank 0 serves (the actor tree
  and HTTP, in its process), a rank > 0 runs only the follower loop (engine/distributed/follower.py);
  nothing starts a lost group again.

MLX is imported only on the launched path (the CLI reports a bad flag before it imports MLX).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_trio.config import EngineConfig

RANK_ENV = "MLX_RANK"  # set by mlx.launch for every rank it starts (engine/distributed/world.py reads it too)


def launched() -> bool:
    return RANK_ENV in os.environ


def refusal(ranks: int, size: int, config: EngineConfig) -> str | None:
    """Why this group cannot serve with these flags, or None: said at start, never as a failure mid-request.

    `ranks`: what --tensor-parallel or --pipeline-parallel asked for (1: whatever the launcher started).
    """
    if ranks > 1 and size != ranks:
        return (f"{ranks} ranks asked for (--tensor-parallel, --pipeline-parallel) but the launcher started "
                f"{size} ranks")
    if size <= 1:
        return None
    if config.prompt_cache_dir is not None:
        return "--prompt-cache-dir is not supported across ranks yet: each rank holds its own shard of the KV"
    if config.serves_adapters:
        return ("LoRA adapters (--lora-modules, --enable-lora-admin) are not supported across ranks yet: an "
                "adapter's matrices would have to be split as its sharded base layers are")
    if config.draft_model is not None:
        return ("--draft-model is not supported across ranks yet: it is loaded whole on every rank, outside the "
                "sharded load, and was never run in lockstep (--prompt-lookup is supported)")
    if config.kv_bits is not None:
        return "--kv-bits is not supported across ranks yet: quantized KV was never run in lockstep"
    return None


@contextmanager
def joined_group(*, stop_timeout_s: float, pipeline: bool = False,
                 relayed_output: bool = True) -> Iterator[tuple[int, int]]:
    """Join mlx.launch's group for the block: yields (rank, size). Rank 0 stops the followers on exit.
    With `pipeline`, the model is split by layers (mlx-lm's `pipeline()`), not tensor parallel.

    A rank > 0 runs its whole life (the follower loop) inside the `with`, then yields: callers
    check `rank` and return. When the followers do not take rank 0's stop within
    `stop_timeout_s` (one is hung: an MLX collective cannot be cancelled), rank 0 exits at once.
    `relayed_output`: the rank's output goes through mlx.launch's pipes (not under mlx-trio's launcher,
    whose ranks write straight to its own output).
    """
    from mlx_trio.engine.distributed.follower import serve_follower
    from mlx_trio.engine.distributed.leader import leader_for
    from mlx_trio.engine.distributed.world import join_world

    world = join_world(pipeline=pipeline)
    if not world.leader:
        # A follower lives until rank 0 stops the group (or is lost): a Ctrl-C is rank 0's to handle.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        serve_follower(world)
        yield world.rank, world.size
        return
    leader = leader_for(world)
    # mlx.launch relays each rank's output through a pipe, and stops reading it once another rank
    # died (it then waits for this one to exit on its SIGTERM). A full pipe must not block this
    # rank's Trio thread in a log write, or it never sees that SIGTERM: so writes that would block
    # are dropped instead (measured: the ring backend's "socket closed" flood filled it).
    # (Not under mlx-trio's own launcher: there the ranks write straight to its output, which they
    # share, and the flag would be set on the launcher's descriptors too.)
    if relayed_output:
        os.set_blocking(sys.stdout.fileno(), False)
        os.set_blocking(sys.stderr.fileno(), False)
    try:
        yield world.rank, world.size
    finally:
        if leader is not None and leader.lost is not None:
            # The group is gone: a stop sent over it would wait on a collective that never completes.
            print(f"mlx-trio: rank 0 exits, the scale-out group was lost ({leader.lost})", file=sys.stderr,
                  flush=True)
            os._exit(1)
        if leader is not None:
            stopper = threading.Thread(target=_stop, args=(leader,), name="stop-followers", daemon=True)
            stopper.start()
            stopper.join(stop_timeout_s)
            if stopper.is_alive():
                print("mlx-trio: the followers did not stop (one is hung or gone); exiting", file=sys.stderr,
                      flush=True)
                os._exit(1)  # the interpreter's exit would wait on MLX threads stuck in a collective


def _stop(leader: Any) -> None:
    """On a thread of its own: tell the followers to stop, then drop the thread's MLX streams."""
    from mlx_trio.engine.lease_thread import release_thread_streams

    try:
        leader.stop_followers()
    finally:
        release_thread_streams()
