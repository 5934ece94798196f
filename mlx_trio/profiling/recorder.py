"""The server-side profile: a daemon thread that samples stacks, drains the lease's job log and cuts windows.

Every `interval_s` the thread takes `sys._current_frames()` and counts each
other thread's stack under its `threading` name (`stacks.StackCounts`), and
moves new job-log entries into the current window's `JobStats`. A *mark*
(`Profiler.mark`, safe from any thread and from a signal handler) closes the
current window and opens the next one; each closed window records wall time, the
lease's busy time, its jobs by name, the engine's counter deltas (decode steps,
tokens, requests), per-thread CPU (`thread_cpu`) and the sampled functions, and
the whole document is rewritten to `path` (also at `stop`). The format is in
docs/profiling.md.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mlx_trio.profiling import thread_cpu
from mlx_trio.profiling.jobs import JobStats
from mlx_trio.profiling.requests import RequestTimeline, summary
from mlx_trio.profiling.stacks import StackCounts

# Thread names the per-unit costs are computed for: the GPU lease's thread and the Trio thread.
LEASE_THREAD = "gpu-lease"
TRIO_THREAD = "MainThread"
# engine counter key (`EngineActors.counters`) -> the window's name for it.
COUNTERS = {"decode_steps": "steps", "decoded_tokens": "tokens", "submitted_rows": "requests"}
TOP_FUNCTIONS = 30  # per thread and kind; the report skips the frames on every sample
# A window keeps at most this many of its jobs one by one (`timeline`): a minute of a serving load's jobs.
TIMELINE_JOBS = 50_000


class _Window:
    """What accumulates between two marks."""

    def __init__(self, index: int, counters: Mapping[str, float]) -> None:
        self.index = index
        self.start = time.perf_counter()
        self.counters = dict(counters)
        self.cpu = thread_cpu.tasks()
        self.process_cpu = thread_cpu.process_cpu_s()
        self.jobs = JobStats(self.start)
        self.stacks: dict[str, StackCounts] = {}
        self.requests: dict[str, dict[str, float]] = {}
        self.timeline: list[tuple[str, float, float]] = []  # the first `TIMELINE_JOBS` jobs, as logged
        self.spans: list[tuple[str, float, float]] = []  # parts of those jobs (`mlx_trio.engine.spans.span`)


class Profiler:
    """Samples this process from a daemon thread and writes windows to `path` as JSON.

    Args:
      path: where the document goes (rewritten atomically at every mark and at stop).
      job_log: the list every `GpuLease` of the process appends its jobs to.
      interval_s: the sampling period.
    """

    def __init__(self, path: Path, *, interval_s: float = 0.005) -> None:
        self.path = path
        self.interval_s = interval_s
        self.job_log: list[tuple[str, float, float]] = []
        self.span_log: list[tuple[str, float, float]] = []  # `mlx_trio.engine.spans.span`: parts of jobs
        self.requests = RequestTimeline()  # the serve path's request phases (`mlx_trio.profiling.request_phase`)
        self.counters: Callable[[], Mapping[str, Any]] | None = None
        self.windows: list[dict[str, Any]] = []
        self._started_at = time.perf_counter()
        self._window = _Window(0, {})
        self._mark = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one window cut at a time (the thread's marks, stop)
        self._thread = threading.Thread(target=self._main, name="mlx-trio-profiler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def mark(self) -> None:
        """Ask the profiler thread to close the current window (and write the file) soon. Signal-safe."""
        self._mark.set()

    def stop(self) -> None:
        """Stop sampling, close the last window, write the file."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._cut()

    # -- the profiler thread -------------------------------------------------------------------

    def _main(self) -> None:
        me = threading.get_ident()
        names: dict[int, str] = {}
        while not self._stop.wait(self.interval_s):
            if self._mark.is_set():
                self._mark.clear()
                self._cut()
            frames = sys._current_frames()
            if any(ident not in names for ident in frames):
                names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
            window = self._window
            for ident, frame in frames.items():
                if ident != me:
                    name = names.get(ident, f"thread-{ident}")
                    counts = window.stacks.get(name)
                    if counts is None:
                        counts = window.stacks[name] = StackCounts()
                    counts.add(frame)
            del frames
            self._drain(window)

    def _drain(self, window: _Window) -> None:
        for request_id, phases in list(self.requests.take().items()):
            known = window.requests.setdefault(request_id, {})
            for phase, at in list(phases.items()):  # the Trio thread may still add to a request it just looked up
                known.setdefault(phase, at)
        window.jobs.add(_take(self.job_log, window.timeline))
        _take(self.span_log, window.spans)

    def _counters(self) -> dict[str, float]:
        try:
            raw = self.counters() if self.counters is not None else {}
        except Exception:  # noqa: BLE001  (an engine between restarts: no counters this time)
            raw = {}
        return {name: float(raw.get(key, 0) or 0) for key, name in COUNTERS.items()}

    def _cut(self) -> None:
        with self._lock:
            window = self._window
            self._drain(window)
            counters = self._counters()
            self._window = _Window(window.index + 1, counters)
            self.windows.append(close_window(window, counters, self._started_at, thread_names()))
            write_json(self.path, self.document())

    def document(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "interval_ms": 1e3 * self.interval_s, "windows": list(self.windows)}


def _take(log: list[tuple[str, float, float]], kept: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Move `log`'s entries out (returned), keeping them in `kept` up to `TIMELINE_JOBS`.

    One slice and one `del` under the GIL: entries appended meanwhile land before or after them.
    """
    taken = log[:len(log)]
    del log[:len(taken)]
    kept.extend(taken[:max(0, TIMELINE_JOBS - len(kept))])
    return taken


def thread_names() -> dict[int, str]:
    """native tid -> `threading` name, for the threads Python knows."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def close_window(window: _Window, counters_end: Mapping[str, float], started_at: float,
                 names: Mapping[int, str]) -> dict[str, Any]:
    """The JSON record of a window that ends now."""
    end = time.perf_counter()
    wall = end - window.start
    deltas = {name: max(0.0, counters_end.get(name, 0.0) - window.counters.get(name, 0.0))
              for name in COUNTERS.values()}
    deltas["lease_jobs"] = window.jobs.count
    end_tasks = thread_cpu.tasks()
    # Threads Python did not start (MLX's own, e.g. the CPU backend's workers) go by their kernel name.
    names = {**{tid: f"{task.comm} (not a Python thread)" for tid, task in end_tasks.items()}, **names}
    threads = thread_cpu.cpu_by_name(window.cpu, end_tasks, names)
    process_end = thread_cpu.process_cpu_s()
    return {
        "index": window.index, "start_s": window.start - started_at, "wall_s": wall,
        "lease_busy_s": window.jobs.busy_s, "lease_busy_fraction": window.jobs.busy_s / wall if wall > 0 else 0.0,
        "counts": deltas,
        "process_cpu_s": (process_end - window.process_cpu
                          if process_end is not None and window.process_cpu is not None else None),
        "threads": threads,
        "per_unit_us": per_unit_us(threads, deltas),
        "jobs": window.jobs.summary(),
        "requests": summary(window.requests),
        "samples": {name: counts.top(TOP_FUNCTIONS) for name, counts in sorted(window.stacks.items())},
        "timeline": timeline(window),
    }


def timeline(window: _Window) -> dict[str, Any]:
    """The window's jobs one by one ([name, start ms, ms], the first `TIMELINE_JOBS`), their parts (`spans`, the
    same) and each request's phases (ms), from the window's start: what the lease ran while a burst waited for
    its first tokens."""
    origin = window.start

    def listed(entries: list[tuple[str, float, float]]) -> list[list[Any]]:
        return [[name, round(1e3 * (start - origin), 3), round(1e3 * (end - start), 3)] for name, start, end in entries]

    return {"jobs": listed(window.timeline), "spans": listed(window.spans),
            "requests": {rid: {phase: round(1e3 * (at - origin), 3) for phase, at in phases.items()}
                         for rid, phases in window.requests.items()}}


def per_unit_us(threads: Mapping[str, Mapping[str, float]], counts: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """CPU µs of the lease and Trio threads per token, decode step, lease job and request (None where 0 of them)."""
    units = {"token": "tokens", "step": "steps", "job": "lease_jobs", "request": "requests"}
    out: dict[str, dict[str, Any]] = {}
    for thread in (LEASE_THREAD, TRIO_THREAD):
        cpu = threads.get(thread, {}).get("cpu_s")
        out[thread] = {unit: (1e6 * cpu / counts[key] if cpu is not None and counts.get(key) else None)
                       for unit, key in units.items()}
    return out


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    """Write atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, path)
