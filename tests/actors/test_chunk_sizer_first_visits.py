"""A cold plan cannot poison the chunk sizer (issue #19): a first visit of a shape that pays a plan is not fitted.

A fake clock: a chunk costs a + b·n + k·n·(c + n/2) (an H200-like cuDNN
prefill, planned), plus 80 ms the first time the process meets its attention
shape (cuDNN's plan build). Chunks come from the real chunked prefill on the
grid (engine/batch/chunked_prefill.py) over a model stand-in, every chunk
sized by the sizer as a busy prefill's is (actors/prefill.py).
"""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.actors.chunk_sizer import ChunkSizer
from mlx_trio.actors.plan_warmup import sizer_shape
from mlx_trio.engine.batch.chunked_prefill import ChunkedPrefill
from mlx_trio.engine.batch.prefill_plans import grid_shapes
from tests.engine.batch.attention_recorder import RecordingModel

GRID, STEP, TARGET, PROMPT = 256, 2048, 0.040, 8500
A, B, K, PLAN_S = 0.002, 2e-5, 3e-9, 0.080


def warm_s(tokens: int, context: int) -> float:
    return A + B * tokens + K * tokens * (context + tokens / 2)


def ideal_sizer() -> ChunkSizer:
    """The sizer fitted to warm costs alone (exact: three samples of the fit's own form)."""
    sizer = ChunkSizer(TARGET, STEP)
    for n, c in [(256, 0), (512, 4096), (2048, 1024)]:
        sizer.record(n, c, warm_s(n, c))
    return sizer


def prefill(sizer: ChunkSizer, planned: set, *, shapes: bool = True) -> list[tuple[int, int]]:
    """One busy prefill of PROMPT tokens: (context, tokens the sizer asked for) per chunk."""
    model = RecordingModel()
    chunked = ChunkedPrefill(model, make_prompt_cache(model), [1] * PROMPT, STEP, grid=GRID)
    asked = []
    while chunked.remaining:
        before = chunked.fed
        limit = sizer.tokens(before) or STEP // 4  # the actor's default before a measurement
        asked.append((before, limit))
        chunked.chunk(limit)
        shape = chunked.last_shape
        assert shape is not None
        seconds = warm_s(*shape[:1], before) + (0.0 if shape in planned else PLAN_S)
        planned.add(shape)
        sizer.record(shape[0], before, seconds, shape if shapes else None)  # computed tokens, as the actor records
    return asked


def _grid_take(limit: int) -> int:
    return max(m for m in (1, 2, 3, 4, 6, 8) if m * GRID <= max(limit, GRID))


def test_cold_plans_leave_the_chosen_chunks_those_of_the_warm_costs() -> None:
    """A cold process, no plans built ahead: the first prompt meets only new shapes and keeps the default chunk
    (nothing to fit yet, never smaller); from the second prompt's fourth chunk on every chunk is the one the
    warm costs give, though each new size it picks pays a plan again (fitted less the plan cost, as estimated
    from shapes met twice)."""
    sizer, ideal, planned = ChunkSizer(TARGET, STEP), ideal_sizer(), set()
    first, *rest = [prefill(sizer, planned) for _ in range(3)]
    assert all(limit == STEP // 4 for _, limit in first)
    later = [(c, limit) for r in rest for c, limit in r][3:]
    assert later and all(_grid_take(limit) == _grid_take(ideal.tokens(c) or 0) for c, limit in later)
    # The chosen sizes vary with the context (the attention term), so the check means something.
    assert len({_grid_take(limit) for _, limit in later}) >= 2
    assert sizer.first_visits_left_out >= len(first)


def test_fitting_every_chunk_as_before_picks_smaller_chunks() -> None:
    """The same run with cold chunks fitted (no shapes named): the plans' cost shrinks the chunks."""
    sizer, ideal, planned = ChunkSizer(TARGET, STEP), ideal_sizer(), set()
    later = [(c, limit) for r in [prefill(sizer, planned, shapes=False) for _ in range(3)][1:] for c, limit in r]
    assert any(_grid_take(limit) < _grid_take(ideal.tokens(c) or 0) for c, limit in later)


def test_plans_built_ahead_are_fitted_from_the_first_chunk() -> None:
    """Every grid shape planned and known: the first prompt's chunks are the warm costs' after three samples."""
    shapes = grid_shapes(GRID, STEP, PROMPT + GRID)
    sizer, ideal = ChunkSizer(TARGET, STEP), ideal_sizer()
    sizer.know(sizer_shape(s) for s in shapes)
    asked = prefill(sizer, {sizer_shape(s) for s in shapes})
    assert sizer.first_visits_left_out == 0
    assert all(_grid_take(limit) == _grid_take(ideal.tokens(c) or 0) for c, limit in asked[3:])


def test_a_first_visit_is_fitted_as_measured_less_the_plan_cost_or_left_out() -> None:
    sizer = ideal_sizer()
    assert sizer.record(512, 2048, warm_s(512, 2048), shape=1)  # as the fit predicts: no plan paid, fitted
    assert not sizer.record(512, 2048, warm_s(512, 2048) + PLAN_S, shape=2)  # a plan's cost, none estimated yet
    assert sizer.record(512, 2048, warm_s(512, 2048), shape=2)  # seen now: fitted; its excess is the plan cost
    assert sizer.record(768, 4096, warm_s(768, 4096) + PLAN_S, shape=3)  # fitted less that cost...
    assert sizer.predict(768, 4096) == pytest.approx(warm_s(768, 4096), rel=1e-6)  # ...so the fit stays exact
    assert not ChunkSizer(TARGET, STEP).record(512, 0, 0.01, shape=4)  # nothing to judge it by: left out
