"""Errors raised by supervisors."""

from __future__ import annotations

from mlx_trio.errors import EngineFailure


class SupervisorGaveUp(EngineFailure):
    """A supervisor restarted its children too often and stopped them all.

    Raised from `Supervisor.run` when more than ``max_restarts`` restarts happened
    within ``period_s`` seconds (OTP's restart intensity). Its ``__cause__`` is the
    last child's exception (``None`` when that child returned instead of raising).
    A distinct type, so that an ``except`` written for a child's own errors cannot
    mask the escalation: a parent supervisor treats it as this supervisor's crash.
    """

    def __init__(self, supervisor_id: str, child_id: str, max_restarts: int, period_s: float) -> None:
        super().__init__(
            f"supervisor {supervisor_id!r} gave up: child {child_id!r} needed more than "
            f"{max_restarts} restarts within {period_s} s"
        )
        self.supervisor_id = supervisor_id
        self.child_id = child_id
