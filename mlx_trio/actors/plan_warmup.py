"""cuDNN's prefill plans built before requests pay for them, in idle time only.

Under prefill-only cuDNN attention every prefill chunk shape cuDNN has not
planned costs a plan build (60-93 ms on an H200, 1B shape, against 6-10 ms
a planned chunk; docs/lab-notes/2026-12-01-h200-prefill-only-cudnn.md), and cuDNN's
plans are per thread, so a new lease thread starts with none. The shape
grid makes the chunks of a prefill that starts on a grid point a short list
(engine/batch/prefill_plans.py). Nothing is planned before the first request
(issue #46: planning 174 shapes at start held /health back for over a minute):
a chunk at a new shape pays its own plan, and the chunk sizer counts its
first visit (docs/design.md §2.2). The shapes of contexts up to `--cudnn-warm-tokens`
are planned one per lease job while nothing else runs (`warm_next`: a request
arriving then waits for at most that one plan), once nothing ran for a while
(actors/prefill.py `PLAN_QUIET_S`: an agent's next turn, sent the moment the
last one ends, finds no plan job in its way). The warm-up never fills more
than `CACHE_SHARE` of cuDNN's plan cache (`MLX_CUDA_SDPA_CACHE_SIZE`,
engine/lease_thread.py), so the shapes of longer contexts, met as requests
go, keep room.

Nothing happens unless the lease thread chose prefill-only cuDNN on CUDA.
"""

from __future__ import annotations

import logging
import os
import time

from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.engine import lease_thread
from mlx_trio.engine.batch.prefill_plans import ChunkShape, PlanWarmer, plan_list
from mlx_trio.errors import LeaseClosed
from mlx_trio.supervision.faults import InjectedFault

log = logging.getLogger("mlx_trio.plans")

# The warm-up fills at most this share of cuDNN's plan cache.
CACHE_SHARE = 0.5
# A progress line at most this often while idle time builds plans.
PROGRESS_S = 10.0


class _Stopped(Exception):
    """A shape's plan failed: the warm-up stops."""


class PlanWarmup:
    """The grid's shapes still to plan on this lease thread, and the lease jobs that plan them."""

    def __init__(self, lease: GpuLease, warmer: PlanWarmer | None, shapes: list[ChunkShape]) -> None:
        self._lease = lease
        self._warmer = warmer
        self._idle = list(shapes)
        self._total = len(shapes)
        self._shown = time.monotonic()  # when the last progress line was logged
        self.planned = 0  # shapes planned so far

    @classmethod
    def none(cls, lease: GpuLease) -> PlanWarmup:
        """A warm-up with nothing to plan."""
        return cls(lease, None, [])

    @classmethod
    async def open(cls, lease: GpuLease, model: object, *, grid: int | None, step_size: int,
                   warm_tokens: int) -> PlanWarmup:
        """The warm-up for `model` on `lease` (`--prefill-grid`, `--prefill-step-size`, `--cudnn-warm-tokens`).

        Empty unless prefill-only cuDNN is on and the model's prefill uses the grid.
        """
        if warm_tokens <= 0 or not prefill_only_cudnn():
            return cls.none(lease)  # no lease job at all
        try:
            warmer, shapes = await lease.run(plan_list, model, grid, step_size, warm_tokens)
        except (LeaseClosed, InjectedFault):
            raise  # not the warm-up's fault: the actor restarts
        except Exception:
            # A warm-up that cannot start must not stop the prefill actor: requests plan as they go.
            log.warning("listing cuDNN's prefill shapes failed; plans are built as requests meet them", exc_info=True)
            return cls.none(lease)
        shapes = shapes[:int(CACHE_SHARE * plan_cache_capacity())]
        if shapes:
            log.info("cuDNN's plans for %d prefill chunk shapes (keys up to %d tokens; --cudnn-warm-tokens) are built "
                     "in idle time; until then a chunk at a new shape builds its own", len(shapes), shapes[-1].keys)
        return cls(lease, warmer, shapes)

    @property
    def pending(self) -> bool:
        """Whether idle time has shapes left to plan."""
        return bool(self._idle)

    async def warm_next(self) -> ChunkShape | None:
        """Plan the next idle-time shape (one lease job); returns it (None when none was left)."""
        if not self._idle:
            return None
        shape = self._idle.pop(0)
        try:
            await self._plan(shape)
        except _Stopped:
            return None
        if not self._idle:
            log.info("cuDNN's plans for all %d prefill chunk shapes are built", self._total)
        elif time.monotonic() - self._shown >= PROGRESS_S:
            self._shown = time.monotonic()
            log.info("cuDNN plans (idle time): %d/%d prefill chunk shapes", self.planned, self._total)
        return shape

    async def _plan(self, shape: ChunkShape) -> None:
        """One shape's chunk; a failure stops the warm-up (requests then plan as they go) and is logged."""
        assert self._warmer is not None
        try:
            await self._lease.run(self._warmer.warm, shape)
            self.planned += 1
        except (LeaseClosed, InjectedFault):
            raise  # not the warm-up's fault: the actor restarts
        except Exception:
            log.warning("building cuDNN's prefill plans failed at %s; the rest are built as requests meet them",
                        shape, exc_info=True)
            self._idle = []
            raise _Stopped from None


def prefill_only_cudnn() -> bool:
    """Whether the lease thread chose prefill-only cuDNN attention (engine/lease_thread.py)."""
    return lease_thread.chosen_backend() == lease_thread.CUDNN_PREFILL


def sizer_shape(shape: ChunkShape) -> tuple[int, int]:
    """`shape` as the chunk sizer names a chunk's shape (`SoloRow.last_chunk_shape`: tokens computed, keys)."""
    return shape.tokens, shape.keys


def plan_cache_capacity() -> int:
    """cuDNN's plan cache capacity in this process: MLX's variable as the lease thread left it."""
    try:
        return int(os.environ.get(lease_thread.CUDNN_PLAN_CACHE_ENV, lease_thread.CUDNN_PLAN_CACHE_SIZE))
    except ValueError:
        return int(lease_thread.CUDNN_PLAN_CACHE_SIZE)
