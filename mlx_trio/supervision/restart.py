"""The two OTP restart decisions: which children restart, and whether a supervisor still may."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TypeVar

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
