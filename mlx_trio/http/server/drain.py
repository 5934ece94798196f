"""Graceful drain: stop admitting, let running requests finish, then cut the rest cleanly.

`Drain` is shared by every incarnation of one `HttpServer` (a restarted HTTP
child keeps draining). Three parts:

* `track()` counts the HTTP requests in flight; the ASGI wrapper
  (`asgi.CountInFlight`) holds it around each request's whole life, response
  body included, so the count is right however a request ends.
* `next_event(events)` is each wait for a generation's next event: it runs
  in a cancel scope that `run` cancels at the deadline, and then raises
  `shutdown_cut()`, which the handlers turn
  into a 503 (nothing sent yet) or an in-band SSE error event followed by
  `data: [DONE]` (a stream already running). Cancelling the wait closes the
  engine stream, which frees the request's KV cache like a client disconnect.
* `run(timeout_s)` sets `draining` (new completions get 503 + Retry-After,
  `/health` 503 "draining"), waits until nothing is in flight or the timeout,
  cuts what is left and waits a bounded moment for those responses to end.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import attrs
import trio

from mlx_trio.events import GenerationEvent
from mlx_trio.http.server.errors import shutdown_cut

log = logging.getLogger("mlx_trio.http")

# After the cut, the error event and [DONE] still have to reach each client.
CUT_GRACE_S = 5.0


@attrs.frozen
class DrainReport:
    """How a drain went: requests in flight when it began, generations cut at the timeout, duration."""

    in_flight_at_start: int
    cut: int
    elapsed_s: float


class Drain:
    """The drain state of one server; Trio-thread only."""

    def __init__(self) -> None:
        self.draining = False
        # Invariant: in_flight is the number of `track()` blocks currently open.
        self.in_flight = 0
        # Set exactly while in_flight == 0; replaced by a fresh Event when it leaves 0.
        self._idle = trio.Event()
        self._idle.set()
        # One scope per wait the cut ends: a generation's next event, a request body (`cutting`).
        self._waits: set[trio.CancelScope] = set()
        # Set at the drain deadline: every wait, present and future, is cancelled.
        self.cut = False
        self.cut_requests = 0

    @contextmanager
    def track(self) -> Iterator[None]:
        if self.in_flight == 0:
            self._idle = trio.Event()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        while self.in_flight:
            await self._idle.wait()

    @contextmanager
    def cutting(self, scope: trio.CancelScope) -> Iterator[None]:
        """While inside, the drain deadline cancels `scope` (at once, if it has passed already)."""
        if self.cut:
            scope.cancel()
        self._waits.add(scope)
        try:
            yield
        finally:
            self._waits.discard(scope)

    async def next_event(self, events: AsyncIterator[GenerationEvent]) -> GenerationEvent:
        """The next event of `events`, unless the drain deadline cuts the wait (`HttpError` 503 `shutdown`).

        Raises `StopAsyncIteration` when `events` ends. One cancel scope per
        wait, never across a `yield` of the caller, so it always belongs to
        the task awaiting it; its registration is inlined (not `cutting`):
        this runs once per streamed event on the Trio thread. A cut wait
        leaves `events` finished (the cancellation went through it).
        """
        with trio.CancelScope() as wait:
            if self.cut:
                wait.cancel()
            waits = self._waits
            waits.add(wait)
            try:
                return await anext(events)
            finally:
                waits.discard(wait)
        # Only a cut gets here: the scope caught its own cancellation.
        self.cut_requests += 1
        raise shutdown_cut()

    async def run(self, timeout_s: float) -> DrainReport:
        """Stop admitting, wait up to `timeout_s` for requests in flight, then cut the rest.

        Returns when nothing is in flight, or `CUT_GRACE_S` after the cut
        (responses still running then are left to hypercorn's shutdown).
        """
        start_s = trio.current_time()
        self.draining = True
        in_flight_at_start = self.in_flight
        log.info("draining: %d request(s) in flight, waiting up to %.1f s", in_flight_at_start, timeout_s)
        with trio.move_on_after(timeout_s):
            await self.wait_idle()
        if self.in_flight:
            log.warning("drain timeout after %.1f s: cutting %d request(s)", timeout_s, self.in_flight)
            self.cut = True
            for wait in list(self._waits):
                wait.cancel()
            with trio.move_on_after(CUT_GRACE_S):
                await self.wait_idle()
        report = DrainReport(in_flight_at_start, self.cut_requests, trio.current_time() - start_s)
        log.info("drained in %.1f s: %d cut", report.elapsed_s, report.cut)
        return report
