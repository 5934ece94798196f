"""Requests on their way to the lane: being prepared, or prepared and not yet submitted (docs/design.md §2.4).

A wave of requests (a closed loop's next turns, an agent's sub-agents fanning
out) reaches the engine within a few milliseconds, but each is prepared (chat
template, tokens) in a worker thread first, GIL-bound, one after another: the
prefill actor sees the wave over the tens of milliseconds the prepares take.
Taking what has come so far cuts the wave into several cohort jobs, whose fixed
costs repeat and whose rows wait behind each other (H200, 1B shape, c=64: 1, 57
and 5 rows; docs/lab-notes/2026-12-04-h200-pass19.md). This count lets the prefill
actor wait for the rest instead (actors/prefill.py `_gather`).

A request counts from the start of its prepare until admission takes it
(`reached`), or, if it is prepared and never submitted (the client left, the
front died), until `ARRIVAL_EXPIRY_S` after its prepare. Used on the Trio
thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

# How long a prepared request that was never submitted still counts as on its way.
ARRIVAL_EXPIRY_S = 1.0


class Arrivals:
    """How many requests are being prepared or are prepared and not yet submitted (`expected`)."""

    def __init__(self) -> None:
        self._preparing = 0
        self._prepared: dict[str, float] = {}  # request id -> when it stops counting (trio clock)

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Count a request while its prepare runs (an error ends it: it never arrives)."""
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    def prepared(self, request_id: str) -> None:
        """The request is prepared: it counts until `reached` or for `ARRIVAL_EXPIRY_S`."""
        self._prepared[request_id] = trio.current_time() + ARRIVAL_EXPIRY_S

    def reached(self, request_id: str) -> None:
        """Admission took the request (or refused it): it is no longer on its way."""
        self._prepared.pop(request_id, None)

    def expected(self) -> int:
        """Requests on their way now (expired ones dropped)."""
        now = trio.current_time()
        for request_id in [rid for rid, until in self._prepared.items() if until <= now]:
            del self._prepared[request_id]
        return self._preparing + len(self._prepared)
