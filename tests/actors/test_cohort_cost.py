"""The fitted cost of a shared cohort job (actors/chunk_sizer.py `CohortCost`): a fixed cost a job plus one per
padded token, from shared cohort jobs alone (issue #20)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_trio.actors.chunk_sizer import COHORT_WINDOW, CohortCost


def _cost(*jobs: tuple[int, float]) -> CohortCost:
    cost = CohortCost()
    for padded, seconds in jobs:
        cost.record(padded, seconds)
    return cost


def test_no_fit_before_two_padded_sizes() -> None:
    """One size cannot tell a job's fixed cost from a cost per token."""
    assert CohortCost().predict(100) is None
    assert _cost((92, 0.012), (92, 0.013), (92, 0.011)).predict(92) is None
    assert _cost((92, 0.012), (92, 0.013), (92, 0.011)).coefficients() == {"per_job_s": 0.0, "per_padded_token_s": 0.0}
    assert not CohortCost().record(0, 0.01) and not CohortCost().record(10, 0.0)


def test_the_fit_is_a_fixed_cost_plus_one_per_padded_token() -> None:
    """The H200's shape (benchmarks/cohort_shapes.py): ~7 ms a job and a little per row."""
    cost = _cost((100, 0.008), (300, 0.010), (1000, 0.017))
    assert cost.coefficients() == {"per_job_s": pytest.approx(0.007), "per_padded_token_s": pytest.approx(1e-5)}
    assert cost.predict(2000) == pytest.approx(0.027)


def test_the_fit_is_least_squares() -> None:
    """Two jobs of 100 tokens (10 and 12 ms) and one of 300 (13 ms): the line through (100, 11 ms) and (300, 13 ms)."""
    cost = _cost((100, 0.010), (100, 0.012), (300, 0.013))
    assert cost.coefficients() == {"per_job_s": pytest.approx(0.010), "per_padded_token_s": pytest.approx(1e-5)}


def test_no_cost_comes_out_below_zero() -> None:
    """A bigger job measured cheaper (noise, a first visit of the smaller one's shape): a fixed cost, their mean."""
    cost = _cost((100, 0.020), (300, 0.010))
    assert cost.coefficients() == {"per_job_s": pytest.approx(0.015), "per_padded_token_s": 0.0}
    assert cost.predict(5000) == pytest.approx(0.015)


def test_the_fit_follows_the_recent_jobs() -> None:
    cost = _cost(*[(100 * (1 + i % 4), 0.050) for i in range(COHORT_WINDOW)])
    assert cost.predict(100) == pytest.approx(0.050)
    for i in range(COHORT_WINDOW):
        cost.record(100 * (1 + i % 4), 0.005 + 1e-5 * 100 * (1 + i % 4))
    assert cost.coefficients() == {"per_job_s": pytest.approx(0.005), "per_padded_token_s": pytest.approx(1e-5)}


@given(st.floats(0.0, 0.05), st.floats(0.0, 1e-3),
       st.lists(st.integers(2, 16384), min_size=2, max_size=COHORT_WINDOW, unique=True))
def test_jobs_of_the_fit_s_own_form_give_back_its_costs(a: float, b: float, sizes: list[int]) -> None:
    if a + b == 0:
        return
    cost = _cost(*[(padded, a + b * padded) for padded in sizes])
    for padded in (1, 500, 16384):
        assert cost.predict(padded) == pytest.approx(a + b * padded, rel=1e-6, abs=1e-12)
