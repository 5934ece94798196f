"""Prefill chunk sizing from measured cost, and which prefill's chunk runs next (issue #19, points 2-3)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_trio.actors.chunk_sizer import CHUNK_QUANTUM, ChunkSizer, fit_nonnegative
from mlx_trio.actors.prefill import AGING_CHUNKS, _Job, next_job

# A chunk's true cost on an imagined machine: a fixed cost, one per token, one per token pair.
A, B, K = 0.004, 2e-6, 1.5e-9


def true_s(n: int, context: int) -> float:
    return A + B * n + K * n * (context + n / 2)


def test_nothing_measured_means_no_size() -> None:
    assert ChunkSizer(0.03, 2048).tokens(0) is None


def test_one_measurement_reads_as_a_cost_per_token() -> None:
    sizer = ChunkSizer(0.030, 2048)
    sizer.record(512, 0, 0.050)  # ~0.1 ms per token at a short context
    assert sizer.tokens(0) == int(0.030 / (0.050 / 512)) // CHUNK_QUANTUM * CHUNK_QUANTUM == 288


def test_the_fit_recovers_the_three_costs() -> None:
    samples = [(1.0, n, n * (c + n / 2), true_s(n, c)) for n, c in [(512, 0), (1024, 512), (256, 4096), (2048, 8192)]]
    a, b, k = fit_nonnegative(samples) or (0, 0, 0)
    assert (a, b, k) == (pytest.approx(A, rel=1e-6), pytest.approx(B, rel=1e-6), pytest.approx(K, rel=1e-6))


def test_a_long_prompt_s_later_chunks_fit_the_target_before_their_context_is_measured() -> None:
    """The old per-bucket averages overshot at each new power of two; the attention term foresees the growth."""
    target = 0.040
    sizer = ChunkSizer(target, 4096)
    context = 0
    while context < 6000:  # one long prompt's chunks, each sized from the ones before
        n = sizer.tokens(context) or 512
        sizer.record(n, context, true_s(n, context))
        context += n
    for far in (12_000, 30_000, 100_000):  # contexts no chunk has reached
        n = sizer.tokens(far)
        assert n is not None and 0.8 * target <= true_s(n, far) <= target


def test_chunks_shrink_as_the_context_grows_and_never_exceed_the_step_or_undercut_the_quantum() -> None:
    sizer = ChunkSizer(0.030, 2048)
    for n, c in [(512, 0), (1024, 0), (512, 8192), (256, 30_000)]:
        sizer.record(n, c, true_s(n, c))
    assert sizer.tokens(0) == 2048  # cheap at a short context: capped at the step size
    assert CHUNK_QUANTUM < sizer.tokens(30_000) < sizer.tokens(8192) < 2048  # type: ignore[operator]
    assert sizer.tokens(10_000_000) == CHUNK_QUANTUM  # absurdly dear: still one quantum


def test_a_chunk_with_a_fixed_cost_converges_to_the_size_that_takes_the_target() -> None:
    """Cost a + b·n: the size sequence settles where one chunk takes the target time."""
    a, b, target = 0.005, 0.0001, 0.030
    sizer = ChunkSizer(target, 4096)
    n = 2048
    for _ in range(40):
        sizer.record(n, 0, a + b * n)
        n = sizer.tokens(0) or n
    assert a + b * n == pytest.approx(target, rel=0.15)


@given(st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 100_000), st.floats(1e-4, 1.0)), min_size=1, max_size=30))
def test_any_measurements_give_a_nonnegative_fit_and_a_size_within_bounds(chunks: list[tuple[int, int, float]]) -> None:
    sizer = ChunkSizer(0.05, 2048)
    for n, c, s in chunks:
        sizer.record(n, c, s)
    assert all(v >= 0 for v in sizer.coefficients().values())
    for c in (0, 5000, 100_000):
        n = sizer.tokens(c)
        assert n is not None and CHUNK_QUANTUM <= n <= 2048 and n % CHUNK_QUANTUM == 0


@attrs.define
class _Row:
    prefill_remaining: int


def test_the_shortest_prefill_runs_next_and_a_passed_over_one_ages_in() -> None:
    long, short = _Job(None, _Row(20_000)), _Job(None, _Row(100))  # type: ignore[arg-type]
    picks = [next_job([long, short]) for _ in range(2 * (AGING_CHUNKS + 1))]
    # The long one runs once in every AGING_CHUNKS + 1 chunks while the short one is still there.
    assert picks == ([short] * AGING_CHUNKS + [long]) * 2
