"""Prefill chunk sizing from measured cost, and which prefill's chunk runs next (issue #19, points 2-3)."""

from __future__ import annotations

import attrs
import pytest

from mlx_trio.actors.chunk_sizer import CHUNK_QUANTUM, ChunkSizer, context_bucket
from mlx_trio.actors.prefill import AGING_CHUNKS, _Job, next_job


def test_nothing_measured_means_no_size() -> None:
    assert ChunkSizer(0.03, 2048).tokens(0) is None


def test_a_chunk_fits_the_target_at_its_measured_cost() -> None:
    sizer = ChunkSizer(0.030, 2048)
    sizer.record(512, 0, 0.050)  # ~0.1 ms per token at a short context
    assert sizer.tokens(0) == int(0.030 / (0.050 / 512)) // CHUNK_QUANTUM * CHUNK_QUANTUM == 288


def test_chunks_shrink_as_the_context_grows_and_never_exceed_the_step_or_undercut_the_quantum() -> None:
    sizer = ChunkSizer(0.030, 2048)
    sizer.record(512, 0, 0.005)  # cheap at a short context: capped at the step size
    sizer.record(512, 8192, 0.200)  # dearer at 8k: attention spans the context
    sizer.record(512, 70_000, 100.0)  # absurdly dear: still one quantum
    assert sizer.tokens(0) == 2048
    assert sizer.tokens(8192) < sizer.tokens(0)
    assert sizer.tokens(70_000) == CHUNK_QUANTUM
    # An unmeasured bucket borrows its nearest measured one below.
    assert context_bucket(8192) < context_bucket(20_000) < context_bucket(70_000)
    assert sizer.tokens(20_000) == sizer.tokens(8192)


def test_a_chunk_with_a_fixed_cost_converges_to_the_size_that_takes_the_target() -> None:
    """Cost a + b·n: the size sequence settles where one chunk takes the target time."""
    a, b, target = 0.005, 0.0001, 0.030
    sizer = ChunkSizer(target, 4096)
    n = 2048
    for _ in range(40):
        sizer.record(n, 0, a + b * n)
        n = sizer.tokens(0) or n
    assert a + b * n == pytest.approx(target, rel=0.15)


@attrs.define
class _Row:
    prefill_remaining: int


def test_the_shortest_prefill_runs_next_and_a_passed_over_one_ages_in() -> None:
    long, short = _Job(None, _Row(20_000)), _Job(None, _Row(100))  # type: ignore[arg-type]
    picks = [next_job([long, short]) for _ in range(2 * (AGING_CHUNKS + 1))]
    # The long one runs once in every AGING_CHUNKS + 1 chunks while the short one is still there.
    assert picks == ([short] * AGING_CHUNKS + [long]) * 2
