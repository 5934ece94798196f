"""One supervised child: its state record, the task that runs it, and the stop ladder."""

from __future__ import annotations

import logging
from typing import Literal

import attrs
import trio

from mlx_trio.supervision.spec import ChildSpec

logger = logging.getLogger("mlx_trio.supervision")

ChildState = Literal["starting", "running", "restarting", "stopping", "stopped", "failed"]


def describe_error(error: BaseException) -> str:
    """Return ``"ValueError: boom"`` for the status tree and log lines."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@attrs.define(eq=False)
class Child:
    """What a supervisor knows about one child id, across its restarts.

    Owned by one supervisor run. The fields after `incarnation` describe the current
    incarnation only and are replaced by `begin`.
    """

    spec: ChildSpec
    state: ChildState = "stopped"
    # Times this id was started again after its first start.
    restarts: int = 0
    # Crashes in a row soon after a start (`Backoff.streak`): how long its next restart waits.
    crash_streak: int = 0
    last_error: str | None = None
    # Invariant: handle is not None only while state == "running".
    handle: object | None = None
    started_at: float | None = None
    incarnation: int = 0
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    finished: trio.Event = attrs.field(factory=trio.Event)
    # Set before this supervisor cancels `scope`, so the exit that follows is read
    # as the stop it is and never as a crash.
    stopping: bool = False

    def begin(self) -> None:
        """Reset the per-incarnation fields before the child is started (again)."""
        if self.incarnation > 0:
            self.restarts += 1
        self.incarnation += 1
        self.state = "starting"
        self.handle = None
        self.started_at = None
        self.scope = trio.CancelScope()
        self.finished = trio.Event()
        self.stopping = False

    def mark_exited(self, state: ChildState) -> None:
        """Record that the current incarnation is no longer serving."""
        self.state = state
        self.handle = None
        self.started_at = None


@attrs.frozen
class Exited:
    """Fact: an incarnation of a child returned or raised after it had started."""

    child: Child
    incarnation: int
    error: Exception | None
    uptime_s: float = 0.0


class _Handshake:
    """A `trio.TaskStatus` that remembers whether ``started()`` was called.

    The runner needs to know whether an exception happened before readiness (a
    failed start, which `nursery.start` re-raises to whoever started the child) or
    after it (a crash, which must never reach the nursery and kill siblings).

    Once the child has moved into the supervisor's nursery its scope is shielded:
    a cancelled supervisor must stop children one by one in reverse start order,
    not have them all cancelled at once by the nursery they share. Until then the
    starter's cancellation must still reach it, or ``nursery.start`` could wait
    forever on a child that ``started()`` left behind in a cancelled starter.
    """

    def __init__(self, inner: trio.TaskStatus[object], child: Child) -> None:
        self._inner = inner
        self._child = child
        self._task = trio.lowlevel.current_task()
        self._target = self._task.eventual_parent_nursery
        self.is_started = False

    def started(self, value: object = None) -> None:
        self._inner.started(value)
        self.is_started = True
        if self._task.parent_nursery is not self._target:
            return  # the starter was cancelled; this child is being cancelled with it
        # Recorded here, in the child's own step, so an exit right after started()
        # can never be overwritten by the starter resuming later.
        child = self._child
        child.scope.shield = True
        child.handle, child.state, child.started_at = value, "running", trio.current_time()


async def run_child(
    child: Child,
    exits: trio.MemorySendChannel[Exited],
    *,
    task_status: trio.TaskStatus[object] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the current incarnation of `child`; use with ``nursery.start``.

    ``nursery.start`` returns the child's handle, or raises what the child raised
    before ``started()`` (``RuntimeError`` if it returned without calling it). After
    ``started()`` only the supervisor's cancellation of ``child.scope`` stops it
    (see `_Handshake`), which ends the task quietly; a return or an ``Exception`` is
    sent as `Exited` on `exits`. No ``Exception`` ever reaches the nursery.
    """
    handshake = _Handshake(task_status, child)
    incarnation, finished = child.incarnation, child.finished
    try:
        with child.scope:
            error: Exception | None = None
            try:
                await child.spec.start(task_status=handshake)
            except Exception as exc:
                if not handshake.is_started:
                    raise
                error = exc
            if not handshake.is_started or child.stopping:
                return
            uptime_s = trio.current_time() - (child.started_at or trio.current_time())
            if error is None:
                logger.debug("child %r returned", child.spec.id)
                child.mark_exited("stopped")
            else:
                logger.warning("child %r crashed: %s", child.spec.id, describe_error(error), exc_info=error)
                child.last_error = describe_error(error)
                child.mark_exited("failed")
            # Stays inside child.scope: stopping this child while the control loop
            # is busy elsewhere cancels this send, so a stop never waits for the loop.
            await exits.send(Exited(child, incarnation, error, uptime_s))
    finally:
        finished.set()


async def stop_child(child: Child) -> None:
    """Stop the current incarnation of `child` with tractor's ladder.

    Ask (cancel its scope), then wait at most ``spec.shutdown_s`` for it to finish.
    A child still running after that is logged and left to finish its cancellation
    on its own: the caller moves on, and the nursery that owns it waits for it.
    Returns at once for a child that is not running. Callers that are themselves
    being cancelled must shield this call; the wait is bounded either way.
    """
    if child.finished.is_set() or child.incarnation == 0:
        if child.state in ("running", "starting", "stopping"):
            child.mark_exited("stopped")
        return
    child.stopping = True
    child.state = "stopping"
    child.scope.cancel()
    with trio.move_on_after(child.spec.shutdown_s) as wait:
        await child.finished.wait()
    if wait.cancelled_caught:
        logger.warning(
            "child %r still running %s s after it was cancelled; moving on",
            child.spec.id,
            child.spec.shutdown_s,
        )
    else:
        logger.debug("child %r stopped", child.spec.id)
    child.mark_exited("stopped")
