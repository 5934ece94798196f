"""Prefill chunk sizes from measured cost: one chunk takes about `--prefill-chunk-ms` (docs/design.md §2).

While other rows decode or other prompts wait, every prefill chunk is a
stall for them: they wait for the whole lease job. A fixed token count is
wrong both ways: a chunk's cost grows with the context it attends over
(512 tokens at 8.5k context cost an H200 22-30 ms on the 1B shape; on this
2-core CPU a 2048-token chunk of SmolLM2 takes minutes), and it differs by
model and machine. So the prefill actor measures each chunk (its lease
job's time on the lease thread) and fits the cost of a chunk of `n` tokens
after `c` cached ones as

    t(n, c) = a + b·n + k·n·(c + n/2)

a fixed cost per job, a cost per token (the weights: MLP, projections) and one
per token pair (attention over the context and the chunk's own causal half), by
least squares over the recent chunks with no coefficient below zero. The next
chunk at a context gets the `n` whose predicted time is the target. Because the
attention term is in the model, a long prompt's later chunks shrink before they
are measured: the older per-context-bucket averages borrowed a cheaper bucket's
cost at each new power of two and overshot the target by up to a fifth (H200,
8.5k prompt, docs/lab-notes/2026-12-01-h200-pass09.md), and each chunk of that
overshoot is a stall of every stream.

**First visits.** A chunk at an attention shape the process has not run before may pay for planning it: cuDNN
builds a plan per exact shape (60-93 ms on an H200, 1B shape, against 6-10 ms a chunk once planned;
docs/lab-notes/2026-12-01-h200-prefill-only-cudnn.md). Fitted as it was, such a chunk made the sizer pick tiny
chunks, each a new shape that paid a plan again (a 40 ms target took an 8.5k prompt 220 chunks). So where the
caller names a chunk's shape (the grid's (tokens computed, keys) pair), a first visit is fitted only as what a
planned chunk would cost: as measured when it is within `FIRST_VISIT_TOLERANCE` of the fit's prediction (no
plan was paid), else less the plan cost, estimated as the median excess of a shape's first visit over its
second (`PLAN_SAMPLES` recent ones); with neither, it is left out. Shapes whose plans were built ahead
(actors/plan_warmup.py) are known from the start (`know`).

**Shared cohort jobs** (actors/prefill.py: short prompts right-padded into
one batch under prefill-only cuDNN) have a fit of their own, `CohortCost`:
seconds against padded tokens (rows x the longest uncached prompt). A
chunk's fit cannot stand in for it: its samples are chunks of one prompt,
each paying a job's fixed cost, so a fit over a burst's lone short prompts
(all about one size) reads that fixed cost as a cost per token and
overstates a padded batch several times (H200, 1B shape, ~46-token prompts:
~0.5 ms a token fitted, against ~7 ms a job plus well under 1 ms a row
measured for shared cohorts; benchmarks/cohort_shapes.py).

Plain Python: the measurements are taken by `timed` on the lease thread.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np

# Chunk sizes are rounded down to a multiple of this (fewer distinct shapes), and never smaller.
CHUNK_QUANTUM = 32
# Recent chunks the fit is taken over: enough to span a long prompt's contexts, few enough to follow a
# machine that warms up or slows down.
WINDOW = 48

# The term subsets a fit may use, in order of preference when they fit equally well (one sample fits
# every single term exactly: a cost per token is the likeliest reading of it, a fixed cost the least).
_SUBSETS = ((0, 1, 2), (1, 2), (0, 1), (0, 2), (1,), (2,), (0,))

# A first visit of a shape costing more than this many times the fit's prediction is left out of the fit: a
# plan build (+60-90 ms) is several times a planned chunk's cost; the per-shape spread of MLX's own kernels
# (24-38 ms against 16-27 on a seen shape) is under it.
FIRST_VISIT_TOLERANCE = 1.5
# Shapes remembered as seen, the oldest forgotten beyond this: twice the plan cache the lease thread sets
# (engine/lease_thread.py), whose evicted plans would be first visits again anyway.
SEEN_SHAPES = 4096
# The plan cost is the median of this many recent (first visit - second visit) differences.
PLAN_SAMPLES = 8

# Recent shared cohort jobs `CohortCost` fits: fewer than chunks (a job holds many requests), and few
# enough to follow a machine that warms up.
COHORT_WINDOW = 32

Sample = tuple[float, float, float, float]  # the three terms' factors (1, n, n·(c + n/2)) and the seconds


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """`fn(*args)` and the seconds it took: run as one lease job, so the time is the job's own."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


# The lease's job log names such a job "timed(SoloRow.prefill_chunk)", not "timed".
timed.names_its_first_argument = True  # type: ignore[attr-defined]


def _solve(rows: Sequence[Sequence[float]], rhs: Sequence[float]) -> list[float] | None:
    """The solution of a small square system by Gaussian elimination with pivoting; None if singular."""
    n = len(rhs)
    m = [list(row) + [r] for row, r in zip(rows, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_nonnegative(samples: Sequence[Sample]) -> tuple[float, float, float] | None:
    """Least-squares (a, b, k) over `samples` with every coefficient ≥ 0; None when no fit exists.

    Three unknowns: the non-negative fit is the best of the ordinary fits
    over each subset of the terms whose coefficients all come out ≥ 0 (an
    exact active-set search, seven small solves; `_SUBSETS` breaks ties). Each term is scaled by its
    largest factor first, so the normal equations stay well conditioned
    although n·c runs to millions. The sums are numpy's (the prefill actor
    refits on its Trio thread after every measured chunk: in plain Python a
    48-sample fit was ~1 ms of it).
    """
    if not samples:
        return None
    data = np.asarray(samples, dtype=np.float64)
    scale = np.abs(data[:, :3]).max(axis=0)
    scale[scale == 0] = 1.0
    xs, ys = data[:, :3] / scale, data[:, 3]
    gram, moment = (xs.T @ xs).tolist(), (xs.T @ ys).tolist()
    best: tuple[float, list[float], tuple[int, ...]] | None = None
    for terms in _SUBSETS:
        coef = _solve([[gram[i][j] for j in terms] for i in terms], [moment[i] for i in terms])
        if coef is None or any(c < 0 for c in coef):
            continue
        residual = float(np.square(ys - xs[:, list(terms)] @ np.asarray(coef)).sum())
        if best is None or residual < best[0] * (1 - 1e-9) - 1e-30:
            best = (residual, coef, terms)
    if best is None:
        return None
    full = [0.0, 0.0, 0.0]
    for c, i in zip(best[1], best[2], strict=True):
        full[i] = c / float(scale[i])
    return full[0], full[1], full[2]


class ChunkSizer:
    """The fitted chunk cost, and the chunk that fits `target_s` at a context.

    `tokens(context)` is None until a chunk was measured: callers then use
    their static default. With one measurement (or measurements that cannot
    separate the terms) the fit is the plainest one they support, e.g. a
    cost per token; each later chunk refines it.
    """

    def __init__(self, target_s: float, max_tokens: int) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self._samples: collections.deque[Sample] = collections.deque(maxlen=WINDOW)
        self._fitted: tuple[float, float, float] | None = None
        self._stale = False  # samples came since the last fit: `_fit` refits once, when next read
        # The attention shapes seen, oldest first (SEEN_SHAPES at most): a first visit's seconds until the
        # second visit compares with it, then None.
        self._seen: dict[Hashable, float | None] = {}
        self._plan_excess: collections.deque[float] = collections.deque(maxlen=PLAN_SAMPLES)
        self.first_visits_left_out = 0

    def know(self, shapes: Iterable[Hashable]) -> None:
        """Count `shapes` as seen: their plans are built already, so their first chunks cost what later ones do."""
        for shape in shapes:
            self._remember(shape, None)

    def record(self, tokens: int, context: int, seconds: float, shape: Hashable | None = None) -> bool:
        """A forward of `tokens` prompt tokens after `context` cached ones took `seconds`; returns whether it was fitted.

        `shape`: the forward's attention shape where shapes repeat (the grid's
        (tokens computed, keys) pair): its first visit is fitted as a planned
        chunk's cost, or not at all (module docstring). None: every sample is fitted as measured.
        """
        if tokens <= 0 or seconds <= 0:
            return False
        if shape is not None:
            if shape not in self._seen:
                self._remember(shape, seconds)
                fitted = self._planned_cost(tokens, context, seconds)
                if fitted is None:
                    self.first_visits_left_out += 1
                    return False
                seconds = fitted
            else:
                first = self._seen[shape]
                if first is not None:
                    self._plan_excess.append(max(first - seconds, 0.0))
                self._remember(shape, None)
        self._samples.append((1.0, float(tokens), tokens * (context + tokens / 2), seconds))
        self._stale = True
        return True

    @property
    def _fit(self) -> tuple[float, float, float] | None:
        """The fit of the samples so far, refitted when read after new samples (several records, one fit)."""
        if self._stale:
            self._fitted, self._stale = fit_nonnegative(self._samples), False
        return self._fitted

    def _planned_cost(self, tokens: int, context: int, seconds: float) -> float | None:
        """A first visit's `seconds` as a planned chunk's: as measured, less the plan cost, or None (unknown)."""
        predicted = self.predict(tokens, context)
        if predicted is not None and seconds <= FIRST_VISIT_TOLERANCE * predicted:
            return seconds
        if self._plan_excess:
            planned = seconds - statistics.median(self._plan_excess)
            return planned if planned > 0 else None
        return None

    def _remember(self, shape: Hashable, first_seconds: float | None) -> None:
        self._seen.pop(shape, None)
        self._seen[shape] = first_seconds
        if len(self._seen) > SEEN_SHAPES:
            del self._seen[next(iter(self._seen))]

    def predict(self, tokens: int, context: int) -> float | None:
        """The fitted seconds of a chunk of `tokens` after `context` cached ones; None before any fit."""
        if self._fit is None:
            return None
        a, b, k = self._fit
        return a + b * tokens + k * tokens * (context + tokens / 2)

    def predict_prefill(self, tokens: int, context: int, step: int) -> float | None:
        """The fitted seconds of a whole prefill in one job: `tokens` after `context`, chunks of at most `step`,
        then token 0's one-token step (a chunk of 1 at the end); None before any fit.

        What a cohort row costs when the rows of a cohort prefill one after
        another (prefill-only cuDNN: actors/prefill.py), each as `SoloRow`
        prefills alone.
        """
        if self._fit is None:
            return None
        total = 0.0
        while tokens > 0:
            n = min(tokens, step)
            total += self.predict(n, context) or 0.0
            context, tokens = context + n, tokens - n
        return total + (self.predict(1, context) or 0.0)

    def tokens(self, context: int) -> int | None:
        """Prompt tokens one chunk after `context` cached ones may hold to take about `target_s`.

        Between `CHUNK_QUANTUM` and `max_tokens` (never more than the prefill
        step size), a multiple of the quantum below the fitted size; None
        when nothing was measured yet.
        """
        if self._fit is None:
            return None
        a, b, k = self._fit
        room = self.target_s - a
        slope = b + k * max(context, 0)
        if room <= 0:
            fit = 0.0
        elif k > 0:  # (k/2)·n² + slope·n = room
            fit = 2 * room / (slope + math.sqrt(slope * slope + 2 * k * room))
        elif slope > 0:
            fit = room / slope
        else:  # only a fixed cost was seen: the size does not change the time
            fit = float(self.max_tokens)
        sized = int(fit) // CHUNK_QUANTUM * CHUNK_QUANTUM
        return min(max(sized, CHUNK_QUANTUM), self.max_tokens)

    def coefficients(self) -> dict[str, float]:
        """The fitted costs (seconds per job, per token, per token pair); zeros before any measurement."""
        a, b, k = self._fit or (0.0, 0.0, 0.0)
        return {"per_chunk_s": a, "per_token_s": b, "per_token_pair_s": k}


class CohortCost:
    """The fitted cost of one shared cohort job: `a + b·padded`, padded = rows x the longest uncached prompt.

    A fixed cost a job (the lease round trip, the rows' caches, token 0's
    batched step) and a cost per padded token, by least squares with neither
    below zero over the last `COHORT_WINDOW` jobs of two rows or more. No
    attention term: the prompts that share forwards are short (at most
    `COHORT_CUDNN_MAX_CONTEXT`, engine/batch/cohort_prefill.py), and each row
    attends over its own prompt only. `predict` is None until two padded
    sizes were measured: one size cannot tell the fixed cost from the cost
    per token, and reading it as either would mis-size every cohort after.
    """

    def __init__(self) -> None:
        self._samples: collections.deque[Sample] = collections.deque(maxlen=COHORT_WINDOW)
        self._fitted: tuple[float, float, float] | None = None
        self._stale = False

    def record(self, padded: int, seconds: float) -> bool:
        """A shared cohort job of `padded` tokens took `seconds`; returns whether it was kept."""
        if padded <= 0 or seconds <= 0:
            return False
        self._samples.append((1.0, float(padded), 0.0, seconds))
        self._stale = True
        return True

    @property
    def _fit(self) -> tuple[float, float, float] | None:
        if self._stale:
            separable = len({sample[1] for sample in self._samples}) > 1
            self._fitted = fit_nonnegative(self._samples) if separable else None
            self._stale = False
        return self._fitted

    def predict(self, padded: int) -> float | None:
        """The fitted seconds of a shared cohort job of `padded` tokens; None before two padded sizes were seen."""
        if self._fit is None:
            return None
        a, b, _ = self._fit
        return a + b * padded

    def coefficients(self) -> dict[str, float]:
        """The fitted costs (seconds per job, per padded token); zeros before a fit."""
        a, b, _ = self._fit or (0.0, 0.0, 0.0)
        return {"per_job_s": a, "per_padded_token_s": b}
