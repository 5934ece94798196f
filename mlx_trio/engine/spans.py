"""Parts of a lease job, timed for the server-side profile (`span`); nothing is kept unless a sink is set.

The profile (mlx_trio/profiling) logs each lease job whole; a span cuts one
into the parts a reader needs to see (a cohort's merge, forwards, token 0
and hand-back; a join's copy): the window's timeline lists them beside the
jobs. The lease (actors/gpu_lease.py) sets the profile's sink when it
starts, since engine/ may not import the profiler. A span around an eval or
a read holds the device's time too. No MLX here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# Where spans go: (name, start, end) in time.perf_counter() seconds; None keeps nothing (the default).
_sink: list[tuple[str, float, float]] | None = None


def log_to(sink: list[tuple[str, float, float]] | None) -> None:
    """Send every later span to `sink` (the running profile's list), or nowhere (None)."""
    global _sink
    _sink = sink


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """Time the block as `name` when a sink is set; otherwise run it as is."""
    sink = _sink
    if sink is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        sink.append((name, start, time.perf_counter()))
