"""Where a request's first token waits: the phases it reaches, timed, summed up per profile window.

The serve path notes each request's phases (`mlx_trio.profiling.request_phase`):
``arrived`` (its handler began), ``prepared`` (tokenized, submitted), ``prefill``
(the prefill actor started its row or its cohort's job), ``token0`` (token 0
sent to its session) and ``first_text`` (the engine stream's first text,
handed to the handler that writes it). A window's summary gives, for each
step between two phases, the p50 / p95 / max milliseconds over the requests
that reached both, so a serving burst's time to first token can be cut into
admission, the wait for the prefill, the prefill job and the way back out
(docs/profiling.md. Appends happen on the Trio
thread; the profiler thread only swaps the dict out. No MLX, no Trio.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

PHASES = ("arrived", "prepared", "prefill", "token0", "first_text")


class RequestTimeline:
    """Per request id, the first time it reached each phase (`note`); `take` hands them over and starts afresh."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, float]] = {}

    def note(self, request_id: str, phase: str, at: float | None = None) -> None:
        """`request_id` reached `phase` at `at` (`time.perf_counter()`, now when None); later repeats are ignored."""
        phases = self._seen.get(request_id)
        if phases is None:
            phases = self._seen[request_id] = {}
        phases.setdefault(phase, time.perf_counter() if at is None else at)

    def take(self) -> dict[str, dict[str, float]]:
        """The requests noted since the last take (one attribute swap: notes land in this batch or the next)."""
        seen, self._seen = self._seen, {}
        return seen


def summary(requests: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per step between consecutive phases (and arrived → first_text): count, p50 / p95 / max ms."""
    steps = [*zip(PHASES, PHASES[1:]), (PHASES[0], PHASES[-1])]
    out: dict[str, Any] = {"requests": len(requests)}
    for a, b in steps:
        spans = sorted(1e3 * (p[b] - p[a]) for p in requests.values() if a in p and b in p)
        if spans:
            out[f"{a}->{b}"] = {"count": len(spans), "p50_ms": statistics.median(spans),
                                "p95_ms": spans[min(len(spans) - 1, int(0.95 * len(spans)))], "max_ms": spans[-1]}
    return out
