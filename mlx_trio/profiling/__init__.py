"""A server-side profile behind `MLX_TRIO_PROFILE=PATH`: lease job log, stack samples, per-thread CPU.

`mlx-trio serve` enters `from_environment()` around its whole run. With the
variable unset nothing happens and every hook below is a no-op; set, a
`recorder.Profiler` runs for the life of the server: every `GpuLease` made
meanwhile logs its jobs into it (`shared_job_log`), the serve command hands
it the engine's counters (`watch_counters`), SIGUSR1 cuts a window, and the
JSON document is written at each cut and when the server stops. How to run
it and what the file holds: docs/profiling.md.
Never imports MLX or the engine: the lease (actors/) calls in here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mlx_trio.profiling.recorder import Profiler

PROFILE_ENV = "MLX_TRIO_PROFILE"
MARK_SIGNAL = getattr(signal, "SIGUSR1", None)

_active: Profiler | None = None


def shared_job_log() -> list[tuple[str, float, float]] | None:
    """The job log a new `GpuLease` should append to: the running profile's, or None (no logging)."""
    return _active.job_log if _active is not None else None


def request_phase(request_id: str, phase: str, at: float | None = None) -> None:
    """Note that a request reached `phase` (profiling/requests.py `PHASES`) now or `at`; no-op without a profile."""
    if _active is not None:
        _active.requests.note(request_id, phase, at)


def shared_span_log() -> list[tuple[str, float, float]] | None:
    """Where parts of lease jobs go (engine/spans.py, set by the lease): the running profile's list, or None."""
    return _active.span_log if _active is not None else None


def watch_counters(counters: Callable[[], Mapping[str, Any]]) -> None:
    """Give the running profile the engine's counters (`EngineActors.counters`); no-op without one."""
    if _active is not None:
        _active.counters = counters


@contextlib.contextmanager
def from_environment(environ: Mapping[str, str] = os.environ) -> Iterator[Profiler | None]:
    """Profile the block if `MLX_TRIO_PROFILE` names a file; write it on the way out.

    From the main thread, SIGUSR1 is installed as the mark signal for the
    block (the previous handler comes back afterwards).
    """
    global _active
    path = environ.get(PROFILE_ENV)
    if not path:
        yield None
        return
    profiler = Profiler(Path(path))
    previous: Any = None
    install = MARK_SIGNAL is not None and threading.current_thread() is threading.main_thread()
    if install:
        previous = signal.signal(MARK_SIGNAL, lambda *_: profiler.mark())
    _active = profiler
    profiler.start()
    try:
        yield profiler
    finally:
        _active = None
        profiler.stop()
        if install:
            signal.signal(MARK_SIGNAL, previous)


__all__ = ["MARK_SIGNAL", "PROFILE_ENV", "Profiler", "from_environment", "shared_job_log", "shared_span_log", "watch_counters"]
