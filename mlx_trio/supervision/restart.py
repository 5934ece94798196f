"""The OTP restart decisions: which children restart, whether a supervisor still may, and how soon."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TypeVar

import attrs

from mlx_trio.supervision.spec import Strategy

T = TypeVar("T")


def affected(strategy: Strategy, ordered: Sequence[T], exited: T) -> list[T]:
    """Return the children, in start order, that restart because `exited` must.

    `ordered` is every child of the supervisor in start order and contains `exited`.
    """
    if strategy is Strategy.ONE_FOR_ONE:
        return [exited]
    if strategy is Strategy.ONE_FOR_ALL:
        return list(ordered)
    return list(ordered[list(ordered).index(exited) :])


class RestartIntensity:
    """OTP's restart intensity: at most `max_restarts` restarts in any `period_s` window.

    A restart at time t still counts at time now while ``t >= now - period_s``,
    exactly as OTP's ``add_restart``.
    """

    def __init__(self, max_restarts: int, period_s: float) -> None:
        self.max_restarts = max_restarts
        self.period_s = period_s
        # Times of the restarts still in the window, oldest first.
        self._times: collections.deque[float] = collections.deque()

    def add(self, now: float) -> bool:
        """Record a restart at `now`; return False if that exceeds the intensity."""
        self._times.append(now)
        while self._times[0] < now - self.period_s:
            self._times.popleft()
        return len(self._times) <= self.max_restarts


@attrs.frozen
class Backoff:
    """How long a restart waits: at once, unless the child keeps crashing right after it starts.

    A crash of an incarnation that ran less than `quick_s` extends the child's
    streak; a longer run ends it. The first crash of a streak restarts at once
    (one fault costs nothing), the n-th waits ``first_s * 2**(n-2)``, at most
    `max_s`. So a child that crashes on every start restarts ever more slowly
    instead of spinning, while one that fails now and then never waits.
    ``Backoff()`` (first_s 0) never waits.
    """

    first_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    max_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    quick_s: float = attrs.field(default=1.0, validator=attrs.validators.ge(0.0))

    def streak(self, previous: int, uptime_s: float) -> int:
        """The streak after a crash of an incarnation that ran `uptime_s` (`previous`: the streak before it)."""
        return previous + 1 if uptime_s < self.quick_s else 1

    def delay_s(self, streak: int) -> float:
        if streak <= 1 or self.first_s <= 0:
            return 0.0
        return min(self.max_s, self.first_s * 2 ** (streak - 2))
