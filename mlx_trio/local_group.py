"""`mlx-trio serve --tensor-parallel N`: this process launches the N local ranks, and launches them again
when the group is lost (docs/scale-out.md "Recovery").

Why this process and not mlx.launch: a group cannot be re-formed inside a running rank. MLX keeps
the first group of each backend for the life of the process (`mx.distributed.init` returns the
cached group on every later call: mlx/distributed/distributed.cpp), has no call that closes a
group, and a collective waiting on a hung peer cannot be cancelled (it holds its thread for good).
So every rank of a lost group, rank 0 included, is a process that must end, and the one that
re-forms the group is this launcher, which is no rank and holds no MLX state. mlx.launch cannot
do it: it fail-stops (SIGTERM to every rank once one died) and exits 0 either way.

The ranks are this same command with `MLX_RANK` and `MLX_HOSTFILE` set, as mlx.launch's ring
backend sets them (a hostfile of one loopback port per rank, fresh ports for every launch); their
output goes straight to this process's stdout and stderr (no relay pipe to fill).

A generation ends when rank 0 exits. Rank 0 exits with `REFORM_EXIT` when it lost its group
(it was started with `REFORM_ENV`: it ends its in-flight requests and drains first). A follower
that dies is seen here first, and told to rank 0 (`LOST_SIGNAL`). Either way the other ranks are
stopped and a new generation starts. Any other exit of rank 0 (a stop signal, a model that does not
load) ends this command with its code.

With a `front` (mlx_trio/front/: what `serve --tensor-parallel N` runs), the public --host/--port is
the front's, for the life of this command; each generation's rank 0 serves on a loopback port of its
own (`--host 127.0.0.1 --port P` added to its command line) and gets the launch's secret (the front's
requests carry it), and `front` is told each launch and each loss, with its reason.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

from mlx_trio.front.group_state import GroupState
from mlx_trio.front.protocol import SECRET_ENV

# Rank 0's exit code when it lost its group and the ranks must be launched again (EX_TEMPFAIL).
REFORM_EXIT = 75
# Set for rank 0 by this launcher: on a lost group, drain and exit with REFORM_EXIT (actors/rank_watch.py).
REFORM_ENV = "MLX_TRIO_REFORM_ON_LOSS"
# A group that is lost this many times within REFORM_WINDOW_S is not launched again: something is wrong
# beyond one rank (a follower that cannot start, a fault that comes back).
MAX_REFORMS = 5
REFORM_WINDOW_S = 300.0
# Sent by the launcher to rank 0 when a follower process exited: the group is lost (actors/rank_watch.py).
LOST_SIGNAL = signal.SIGUSR1
# How long a follower may take to exit once rank 0 ended (it sees rank 0 go at its next collective).
_FOLLOWER_EXIT_S = 10.0
# How long rank 0 may take to drain and exit once a follower died, before it is killed.
_LEADER_EXIT_S = 60.0
_POLL_S = 0.25


@attrs.define
class LocalGroup:
    """Launches `ranks` local ranks of `argv` (an `mlx-trio` command line) until rank 0 stops for good."""

    ranks: int
    argv: list[str]
    # What each rank runs, before `argv` (another program only in tests).
    program: list[str] = attrs.field(factory=lambda: [sys.executable, "-m", "mlx_trio.cli"])
    # The front to tell about each generation, and the secret its requests carry (None: no front).
    front: GroupState | None = None
    secret: str = ""
    stopping: bool = False
    generation: int = 0
    _processes: list[subprocess.Popen[bytes]] = attrs.field(factory=list)
    _reason: str = "starting: the ranks are loading the model"  # why no generation serves, for the front

    def run(self) -> int:
        """Launch, watch, re-launch; rank 0's last exit code (1 when re-forming gave up)."""
        previous = {signum: signal.signal(signum, self._stop) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._generations()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _generations(self) -> int:
        reforms: list[float] = []
        while True:
            code = self._one_generation()
            if self.stopping or code != REFORM_EXIT:
                return code
            now = time.monotonic()
            reforms = [t for t in reforms if now - t < REFORM_WINDOW_S] + [now]
            if len(reforms) > MAX_REFORMS:
                print(f"mlx-trio: the scale-out group was lost {len(reforms)} times within "
                      f"{REFORM_WINDOW_S:g} s; not launching it again", file=sys.stderr, flush=True)
                return 1
            print(f"mlx-trio: the scale-out group was lost; launching its {self.ranks} ranks again",
                  file=sys.stderr, flush=True)

    def _one_generation(self) -> int:
        self.generation += 1
        *ports, http = free_ports(self.ranks + 1)
        argv, leader_env = list(self.argv), {REFORM_ENV: "1"}
        if self.front is not None:
            argv += ["--host", "127.0.0.1", "--port", str(http)]  # after the user's: the last one counts
            leader_env[SECRET_ENV] = self.secret
            self.front.launched(self.generation, http, self._reason)
        with tempfile.TemporaryDirectory(prefix="mlx-trio-ranks-") as scratch:
            hostfile = Path(scratch) / "hosts.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
            base = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
            self._processes = [
                subprocess.Popen([*self.program, *argv],
                                 env={**base, "MLX_RANK": str(rank), **(leader_env if rank == 0 else {})})
                for rank in range(self.ranks)]
            try:
                code = self._watch()
            finally:
                self._end_followers()
        if code == REFORM_EXIT:
            self._reason = f"the scale-out group is being relaunched: {self._reason}"
            if self.front is not None:
                self.front.lost(self._reason)
        return code

    def _watch(self) -> int:
        """Until rank 0 exits: its exit code, `REFORM_EXIT` when a follower died first.

        A follower's death is told to rank 0 (`LOST_SIGNAL`, once): its collective with the dead
        rank may never return on its own (measured on the ring backend: sometimes it raises,
        sometimes it waits for good). A rank 0 that does not listen yet (still starting: no request
        is in flight) dies of the signal, which ends the generation just as well.
        """
        leader, died_at = self._processes[0], None
        while (code := leader.poll()) is None:
            if died_at is None and not self.stopping and (dead := self._dead_follower()) is not None:
                died_at = time.monotonic()
                if self.front is not None:
                    self.front.lost(f"the scale-out group was lost: {dead}")
                leader.send_signal(LOST_SIGNAL)
            if died_at is not None and time.monotonic() - died_at > _LEADER_EXIT_S:
                leader.kill()  # it cannot even drain: start again anyway
            time.sleep(_POLL_S)
        # Rank 0 often sees a killed follower first (its collective fails) and is gone before the poll above.
        self._reason = self._dead_follower() or "rank 0 lost its group (a follower hung or was unreachable)"
        return REFORM_EXIT if died_at is not None else code

    def _dead_follower(self) -> str | None:
        """The first follower that exited, and how, or None."""
        dead = [(rank, p.returncode) for rank, p in enumerate(self._processes) if rank and p.poll() is not None]
        return f"rank {dead[0][0]} exited ({_exit_status(dead[0][1])})" if dead else None

    def _end_followers(self) -> None:
        """Followers leave once rank 0 stopped them (or is gone); one that does not (hung) is killed."""
        deadline = time.monotonic() + _FOLLOWER_EXIT_S
        for process in self._processes[1:]:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _stop(self, _signum: int, _frame: object) -> None:
        """SIGINT or SIGTERM: rank 0 drains and stops its followers (which ignore SIGINT); no new launch."""
        self.stopping = True
        for process in self._processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)


def free_ports(count: int) -> list[int]:
    """`count` loopback ports free now (bound together, so distinct; closed before the ranks bind them)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _exit_status(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
