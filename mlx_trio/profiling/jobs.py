"""Aggregating the GPU lease's job log: per job name, count, total and percentiles; the busy time of a window.

The log is `GpuLease.job_log`: (name, start, end) in `time.perf_counter()`
seconds, appended on the lease thread. A job counts in the window in which
it ended; its busy time is clipped to the window's start, so the busy
fraction of back-to-back windows never exceeds 1.
"""

from __future__ import annotations

import array
from collections.abc import Iterable
from typing import Any


def percentile(sorted_values: "array.array[float] | list[float]", q: float) -> float:
    """The nearest-rank `q`-quantile (0..1) of an ascending sequence; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1))))
    return sorted_values[rank]


class JobStats:
    """The jobs of one window, by name."""

    def __init__(self, window_start: float) -> None:
        self.window_start = window_start
        self.busy_s = 0.0
        self._durations: dict[str, array.array[float]] = {}

    def add(self, entries: Iterable[tuple[str, float, float]]) -> None:
        for name, start, end in entries:
            self._durations.setdefault(name, array.array("d")).append(end - start)
            self.busy_s += max(0.0, end - max(start, self.window_start))

    @property
    def count(self) -> int:
        return sum(len(d) for d in self._durations.values())

    def summary(self) -> dict[str, dict[str, Any]]:
        """{name: count, total_s, p50_ms, p95_ms, max_ms}, the largest total first."""
        out = {}
        for name, durations in sorted(self._durations.items(), key=lambda kv: -sum(kv[1])):
            ordered = sorted(durations)
            out[name] = {"count": len(ordered), "total_s": sum(ordered), "p50_ms": 1e3 * percentile(ordered, 0.5),
                         "p95_ms": 1e3 * percentile(ordered, 0.95), "max_ms": 1e3 * ordered[-1]}
        return out
