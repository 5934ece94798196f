"""One log line per request: id, token counts, time to first token, decode speed, outcome."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mlx_trio.events import Finished, GenerationEvent, TextDelta, Usage

log = logging.getLogger("mlx_trio.http.requests")


class RequestLog:
    """Watches one request's events and logs a single info line when it ends.

    `done` may be called more than once (a stream's `finally` and an error
    path); only the first call logs, so every request logs exactly one line.
    """

    def __init__(self, request_id: str, *, kind: str, stream: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.request_id = request_id
        self._kind = f"{kind}{' stream' if stream else ''}"
        self._clock = clock
        self._start_s = clock()
        self._first_token_s: float | None = None
        self._usage: Usage | None = None
        self._logged = False

    def saw(self, event: GenerationEvent) -> None:
        if isinstance(event, TextDelta) and self._first_token_s is None:
            self._first_token_s = self._clock()
        elif isinstance(event, Finished):
            self._usage = event.usage
            if self._first_token_s is None:  # e.g. an immediate EOS: no visible text, one token
                self._first_token_s = self._clock()

    def done(self, outcome: str) -> None:
        """Log the line; `outcome` is the finish reason, "cancelled" or an error type."""
        if self._logged:
            return
        self._logged = True
        end_s = self._clock()
        usage = self._usage
        counts = (f"prompt={usage.prompt_tokens} cached={usage.cached_tokens} completion={usage.completion_tokens}"
                  if usage else "prompt=? completion=?")
        if self._first_token_s is None:
            timing = "ttft=- tok/s=-"
        else:
            ttft_s = self._first_token_s - self._start_s
            decode_s = end_s - self._first_token_s
            # The first token's time is in the TTFT; the rate covers the tokens after it.
            after_first = usage.completion_tokens - 1 if usage else 0
            rate = after_first / decode_s if after_first > 0 and decode_s > 0 else 0.0
            timing = f"ttft={ttft_s:.3f}s tok/s={rate:.1f}"
        log.info("%s %s %s %s finish=%s total=%.3fs", self.request_id, self._kind, counts, timing, outcome,
                 end_s - self._start_s)
