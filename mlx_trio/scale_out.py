"""How one `mlx-trio serve` process takes its place in an mlx.distributed group (docs/scale-out.md).

Three cases, decided before anything binds a port or loads a model:
* not launched, `--tensor-parallel 1`: one process, nothing changes;
* not launched, `--tensor-parallel N`: start N local ranks of this same command through MLX's
  launcher (`mlx.launch -n N`, the ring backend over loopback) and wait for them;
* launched by `mlx.launch` (any backend, any hosts): join the group; rank 0 serves (the actor
  tree and HTTP), a rank > 0 runs only the follower loop (engine/distributed/follower.py).

MLX is imported only on the launched path (the CLI reports a bad flag before it imports MLX).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

# mlx.launch has no `python -m` entry of its own: this runs its console script's function.
_LAUNCHER = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
RANK_ENV = "MLX_RANK"  # set by mlx.launch for every rank it starts (engine/distributed/world.py reads it too)


def launched() -> bool:
    return RANK_ENV in os.environ


def launch_local_ranks(ranks: int, argv: Sequence[str]) -> int:
    """Run this `mlx-trio` command as `ranks` local ranks under mlx.launch (ring backend); their exit code.

    SIGINT or SIGTERM here goes to every rank as SIGINT: rank 0 drains its requests and stops the
    followers, which ignore the signal itself. When a rank exits with an error mlx.launch sends
    SIGTERM to the others and stops relaying their output (it fail-stops the group): rank 0 drains
    and exits too, and this command ends, for a process supervisor to start again (mlx.launch itself does not pass a Ctrl-C on to its ranks, measured with mlx 0.32.4).
    """
    command = [sys.executable, "-c", _LAUNCHER, "-n", str(ranks), "--backend", "ring",
               "--python", sys.executable, "-m", "mlx_trio.cli", *argv]
    launcher = subprocess.Popen(command, start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        # To the ranks, not the launcher: it relays their output until they are done.
        ranks = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        for pid in ranks:
            os.kill(int(pid), signal.SIGINT)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    return launcher.wait()


def refusal(tensor_parallel: int, size: int, prompt_cache_dir: object) -> str | None:
    """Why this group cannot serve with these flags, or None."""
    if tensor_parallel > 1 and size != tensor_parallel:
        return f"--tensor-parallel {tensor_parallel} but mlx.launch started {size} ranks"
    if size > 1 and prompt_cache_dir is not None:
        return "--prompt-cache-dir is not supported across ranks yet: each rank holds its own shard of the KV"
    return None


@contextmanager
def joined_group(*, stop_timeout_s: float) -> Iterator[tuple[int, int]]:
    """Join mlx.launch's group for the block: yields (rank, size). Rank 0 stops the followers on exit.

    A rank > 0 runs its whole life (the follower loop) inside the `with`, then yields: callers
    check `rank` and return. When the followers do not take rank 0's stop within
    `stop_timeout_s` (one is hung: an MLX collective cannot be cancelled), rank 0 exits at once.
    """
    from mlx_trio.engine.distributed.follower import serve_follower
    from mlx_trio.engine.distributed.leader import leader_for
    from mlx_trio.engine.distributed.world import join_world

    world = join_world()
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
    os.set_blocking(sys.stdout.fileno(), False)
    os.set_blocking(sys.stderr.fileno(), False)
    try:
        yield world.rank, world.size
    finally:
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
