"""`Retrying`: a nested supervisor whose giving up is an outage with a retry, not its parent's crash.

OTP escalates: a supervisor that gives up crashes its parent, and at the root
the node dies. A server wants the opposite for its engine subtree: when the
engine keeps failing, the HTTP child must stay up to say so (`/health` 503 with
the reason, new requests 503 with Retry-After) while the engine is started again,
later each time. `Retrying` is that child: it runs the supervisor, and when the
supervisor gives up (or a later run fails to start) it records why and until
when (`down`), waits, and runs it again. The parent never sees the failure.
"""

from __future__ import annotations

import logging
import math

import attrs
import trio

from mlx_trio.supervision.child import describe_error
from mlx_trio.supervision.errors import SupervisorGaveUp
from mlx_trio.supervision.spec import ChildSpec
from mlx_trio.supervision.supervisor import Supervisor

log = logging.getLogger("mlx_trio.supervision")


@attrs.frozen
class Down:
    """Why a retried supervisor is not running, and when (Trio time) it starts again."""

    reason: str
    retry_at: float

    def retry_in_s(self) -> float:
        return max(0.0, self.retry_at - trio.current_time())


class Retrying:
    """Runs `supervisor` as a child that outlives its giving up; see the module docstring.

    The n-th retry in a row waits ``first_s * 2**(n-1)``, at most `max_s`; a run
    that lasted `stable_s` or longer starts the count again. The first run's
    start failure is raised (nothing has worked yet: a parent, and so the
    caller, must hear of it); every later failure is retried.
    """

    def __init__(self, supervisor: Supervisor, *, first_s: float = 1.0, max_s: float = 30.0,
                 stable_s: float = 60.0) -> None:
        self.supervisor = supervisor
        self.first_s, self.max_s, self.stable_s = first_s, max_s, stable_s
        # Invariant: not None exactly while the supervisor is down, waiting for its next run.
        self.down: Down | None = None
        self.retries = 0  # runs started after a give-up

    def as_child(self) -> ChildSpec:
        """A spec for the parent: its handle is the supervisor (so status trees nest as usual)."""
        return ChildSpec(id=self.supervisor.id, start=self.run, shutdown_s=math.inf, kind="supervisor")

    async def run(self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the supervisor until cancelled or stopped, through any number of give-ups."""
        streak = 0
        started = trio.current_time()
        try:
            await self.supervisor.run(task_status=task_status)
            return  # stopped on purpose (`Supervisor.stop`)
        except SupervisorGaveUp as exc:  # anything else here is the first start's failure: raised
            error: Exception = exc
        while True:
            streak = 1 if trio.current_time() - started >= self.stable_s else streak + 1
            delay = min(self.max_s, self.first_s * 2 ** (streak - 1))
            self.down = Down(describe_error(error), trio.current_time() + delay)
            log.error("%s gave up (%s); starting it again in %.1f s", self.supervisor.id, describe_error(error), delay)
            await trio.sleep(delay)
            self.down = None
            self.retries += 1
            started = trio.current_time()
            try:
                await self.supervisor.run()
                return
            except Exception as exc:  # noqa: BLE001  (any failure of a later run is an outage to retry)
                error = exc
