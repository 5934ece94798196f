"""One log line per request (id, token counts, time to first token, decode speed, outcome), and its Prometheus samples.

When the prompt left a close prompt-cache entry, the line also says where
(`diverged_at=POSITION/ENTRY_TOKENS`) and shows the text on each side:
`before` (shared), then `cached` (the entry's) against `prompt` (this request's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlx_trio.events import CacheDivergence, Finished, GenerationEvent, TextDelta, Usage

if TYPE_CHECKING:
    from mlx_trio.http.server.prometheus import Metrics

log = logging.getLogger("mlx_trio.http.requests")


class RequestLog:
    """Watches one request's events and logs a single info line when it ends.

    `done` may be called more than once (a stream's `finally` and an error
    path); only the first call logs, so every request logs exactly one line.
    With `metrics`, it also observes time to first token, the latency between
    later tokens, and at `done` the outcome and token counts.
    """

    def __init__(self, request_id: str, *, kind: str, stream: bool,
                 clock: Callable[[], float] = time.monotonic, metrics: Metrics | None = None) -> None:
        self.request_id = request_id
        self._kind = f"{kind}{' stream' if stream else ''}"
        self._clock = clock
        self._start_s = clock()
        self._first_token_s: float | None = None
        self._last_token_s: float | None = None
        self._metrics = metrics
        self._usage: Usage | None = None
        self._divergence: CacheDivergence | None = None
        self._logged = False

    def saw(self, event: GenerationEvent) -> None:
        if isinstance(event, TextDelta):
            if self._first_token_s is None:
                self._first_token(self._clock())
            elif event.token_ids and self._last_token_s is not None and self._metrics is not None:
                # A delta may carry several tokens (the detokenizer held text back): spread the gap.
                now_s, count = self._clock(), len(event.token_ids)
                for _ in range(count):
                    self._metrics.inter_token.observe((now_s - self._last_token_s) / count)
                self._last_token_s = now_s
        elif isinstance(event, Finished):
            self._usage, self._divergence = event.usage, event.cache_divergence
            if self._first_token_s is None:  # e.g. an immediate EOS: no visible text, one token
                self._first_token(self._clock())

    def _first_token(self, now_s: float) -> None:
        self._first_token_s = self._last_token_s = now_s
        if self._metrics is not None:
            self._metrics.ttft.observe(now_s - self._start_s)

    def done(self, outcome: str) -> None:
        """Log the line; `outcome` is the finish reason, "cancelled" or an error type."""
        if self._logged:
            return
        self._logged = True
        end_s = self._clock()
        usage = self._usage
        if self._metrics is not None:
            self._metrics.generations.labels(outcome=outcome).inc()
            if usage is not None:
                self._metrics.finished(usage)
        counts = (f"prompt={usage.prompt_tokens} cached={usage.cached_tokens} completion={usage.completion_tokens}"
                  if usage else "prompt=? completion=?")
        if usage is not None and usage.speculative_proposed:
            counts += f" accepted={usage.speculative_accepted}/{usage.speculative_proposed}"
        if self._first_token_s is None:
            timing = "ttft=- tok/s=-"
        else:
            ttft_s = self._first_token_s - self._start_s
            decode_s = end_s - self._first_token_s
            # The first token's time is in the TTFT; the rate covers the tokens after it.
            after_first = usage.completion_tokens - 1 if usage else 0
            rate = after_first / decode_s if after_first > 0 and decode_s > 0 else 0.0
            timing = f"ttft={ttft_s:.3f}s tok/s={rate:.1f}"
        log.info("%s %s %s %s finish=%s total=%.3fs%s", self.request_id, self._kind, counts, timing, outcome,
                 end_s - self._start_s, _diverged(self._divergence))


def _diverged(divergence: CacheDivergence | None) -> str:
    if divergence is None:
        return ""
    return (f" diverged_at={divergence.position}/{divergence.entry_tokens} before={divergence.before!r}"
            f" cached={divergence.cached!r} prompt={divergence.prompt!r}")
