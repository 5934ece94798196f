"""Prefill chunk sizes from measured cost: one chunk takes about `--prefill-chunk-ms` (docs/design.md §2).

While other rows decode or other prompts wait, every prefill chunk is a
stall for them: they wait for the whole lease job. A fixed token count is
wrong both ways: a chunk's cost grows with the context it attends over
(512 tokens at 8.5k context cost an H200 22-30 ms on the 1B shape; on this
2-core CPU a 2048-token chunk of SmolLM2 takes minutes), and it differs by
model and machine. So the prefill actor measures each chunk (its lease
job's time on the lease thread) and keeps an exponential moving average of
the seconds per token per context bucket (powers of two of the tokens
already in the cache); the next chunk at that context gets as many tokens
as fit the target. A chunk that costs `a + b·n` converges to the `n` whose
time is the target: a too-small chunk measures a higher per-token cost
(its fixed overhead), so the next one is larger, and the other way round.

Plain Python: the measurements are taken by `timed` on the lease thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# Weight of the newest measurement in a bucket's moving average.
EMA_WEIGHT = 0.3
# Chunk sizes are rounded down to a multiple of this (fewer distinct shapes), and never smaller.
CHUNK_QUANTUM = 32


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """`fn(*args)` and the seconds it took: run as one lease job, so the time is the job's own."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def context_bucket(context: int) -> int:
    """Powers of two of the tokens already in the cache: 0, 1, 2-3, 4-7, ... share a bucket each."""
    return max(context, 0).bit_length()


class ChunkSizer:
    """Seconds per prompt token by context bucket, and the chunk that fits `target_s` at a context.

    `tokens(context)` is None until some bucket was measured: callers then use
    their static default. An unmeasured bucket borrows its nearest measured
    neighbour below (or above): the first chunk there measures it.
    """

    def __init__(self, target_s: float, max_tokens: int) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self._per_token: dict[int, float] = {}

    def record(self, tokens: int, context: int, seconds: float) -> None:
        """A forward of `tokens` prompt tokens after `context` cached ones took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        bucket = context_bucket(context)
        cost = seconds / tokens
        old = self._per_token.get(bucket)
        self._per_token[bucket] = cost if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * cost

    def per_token_s(self, context: int) -> float | None:
        """The moving average for `context`'s bucket, or its nearest measured neighbour's; None if none is."""
        if not self._per_token:
            return None
        bucket = context_bucket(context)
        below = [b for b in self._per_token if b <= bucket]
        nearest = max(below) if below else min(self._per_token)
        return self._per_token[nearest]

    def tokens(self, context: int) -> int | None:
        """Prompt tokens one chunk after `context` cached ones may hold to take about `target_s`.

        Between `CHUNK_QUANTUM` and `max_tokens` (never more than the prefill
        step size), a multiple of the quantum below that; None when nothing
        was measured yet.
        """
        cost = self.per_token_s(context)
        if cost is None:
            return None
        fit = int(self.target_s / cost) // CHUNK_QUANTUM * CHUNK_QUANTUM
        return min(max(fit, CHUNK_QUANTUM), self.max_tokens)

    def buckets(self) -> dict[int, float]:
        """The per-token seconds by bucket (a copy): what /stats shows."""
        return dict(self._per_token)
