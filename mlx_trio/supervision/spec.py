"""The OTP vocabulary of a child: how it starts, when it restarts, how long it may take to stop."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable

import attrs


class Restart(enum.Enum):
    """Whether a child that exited is started again (OTP's restart type)."""

    PERMANENT = "permanent"
    """Always restarted, whether it returned or raised."""

    TRANSIENT = "transient"
    """Restarted only when it raised; a normal return leaves it stopped."""

    TEMPORARY = "temporary"
    """Never restarted; forgotten by its supervisor as soon as it exits."""


class Strategy(enum.Enum):
    """Which children a supervisor restarts when one of them must be restarted."""

    ONE_FOR_ONE = "one_for_one"
    """Only the child that exited."""

    ONE_FOR_ALL = "one_for_all"
    """Every child: all others are stopped in reverse start order, then all start in order."""

    REST_FOR_ONE = "rest_for_one"
    """The child that exited and every child started after it, which may depend on it."""


@attrs.frozen
class ChildSpec:
    """How a supervisor starts, restarts and stops one child.

    `start` is called as ``await start(task_status=...)``. It calls
    ``task_status.started(handle)`` once it is ready to serve, where `handle` is the
    object others use to reach it (the actor itself, like an OTP pid), then runs
    until it is cancelled, returns or raises. An exception before ``started()`` is a
    failed start; one after it is a crash.

    `shutdown_s` bounds how long the supervisor waits for the child to finish once
    its cancel scope is cancelled before it moves on to stop the next child; use
    ``math.inf`` for a child that must be stopped before anything started earlier
    (OTP's ``infinity``, the default for nested supervisors). `kind` is a free label
    shown in the status tree ("gpu-lease", "decode-step", "session", "supervisor").
    """

    id: str
    start: Callable[..., Awaitable[object]]
    restart: Restart = Restart.PERMANENT
    shutdown_s: float = attrs.field(default=5.0, validator=attrs.validators.ge(0.0))
    kind: str = "worker"
