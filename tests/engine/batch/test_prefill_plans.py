"""cuDNN plans built ahead (issue #19): the warm-up runs exactly the attention shapes a real prefill on the grid runs.

The CPU has no cuDNN, so what is checked is the list of attention calls
(query tokens, keys, the keys' buffer, which fixes their strides, and the mask:
cuDNN's plan key, docs/design.md §4.6), recorded by a model stand-in over
mlx-lm's own caches (tests/engine/batch/attention_recorder.py), for the
warm-up's chunks and for real chunked prefills with any chunk limits.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.batch.chunked_prefill import ChunkedPrefill
from mlx_trio.engine.batch.prefill_plans import ChunkShape, PlanWarmer, chunk_sizes, grid_shapes, plan_list
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv import cache_clone, decode_layout
from mlx_trio.engine.prompt_cache.ram_tier import CacheHit
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model
from tests.engine.batch.attention_recorder import AttentionCall, RecordingModel

GRID, STEP, MAX_KEYS = 256, 2048, 4096


def _prefill_calls(model: RecordingModel, prompt_tokens: int, limits: list[int | None]) -> list[list[AttentionCall]]:
    """A real chunked prefill on the grid from an empty cache; each chunk's attention calls (queries of 2+ tokens)."""
    prefill = ChunkedPrefill(model, make_prompt_cache(model), [1] * prompt_tokens, STEP, grid=GRID)
    chunks = []
    for limit in limits:
        if not prefill.remaining:
            break
        prefill.chunk(limit)
        chunks.append([call for call in model.take_calls() if call.queries > 1])
    while prefill.remaining:
        prefill.chunk()
        chunks.append([call for call in model.take_calls() if call.queries > 1])
    return chunks


def _warm_calls(model: RecordingModel, warmer: PlanWarmer, shape: ChunkShape) -> list[AttentionCall]:
    model.take_calls()
    warmer.warm(shape)
    return [call for call in model.take_calls() if call.queries > 1]


def test_each_warm_up_chunk_is_the_chunk_a_real_prefill_runs_at_that_shape() -> None:
    """Reach every listed shape with a real prefill (one-step chunks up to its context, then its chunk)."""
    model = RecordingModel()
    warmer = PlanWarmer(model, GRID)
    shapes = grid_shapes(GRID, STEP, MAX_KEYS)
    assert len(shapes) == len(set(shapes)) == 16 + 15 + 14 + 13 + 11 + 9  # sizes 256..2048, keys up to 4096
    for shape in shapes:
        warm = _warm_calls(model, warmer, shape)
        assert warm and all(call == AttentionCall(shape.tokens, shape.keys, shape.keys, "causal") for call in warm)
        # A prompt long enough that no chunk takes its whole rest (grid_chunk's `rest`): each runs as asked.
        chunks = _prefill_calls(model, shape.keys + 1 + 2 * STEP, [GRID] * (shape.context // GRID) + [shape.tokens])
        assert chunks[shape.context // GRID] == warm


def test_every_chunk_of_any_real_prefill_from_the_grid_is_a_warmed_shape() -> None:
    """Any prompt length, any chunk limits (a lone request's full chunks, a sizer's asks, tiny ones)."""
    model = RecordingModel()
    warmer = PlanWarmer(model, GRID)
    warmed = {call for shape in grid_shapes(GRID, STEP, MAX_KEYS) for call in _warm_calls(model, warmer, shape)}
    rng = random.Random(0)
    seen: set[AttentionCall] = set()
    for _ in range(150):
        # A padded last chunk ends up to 511 tokens past the prompt (grid_chunk's `rest`, step 2048).
        prompt = rng.randint(2, MAX_KEYS + 1 - 512)
        limits = [rng.choice([None, rng.randint(1, STEP), rng.randint(1, 600)]) for _ in range(40)]
        for chunk in _prefill_calls(model, prompt, limits):
            seen.update(chunk)
    assert seen <= warmed
    assert len(seen) > len(warmed) // 2  # the random prefills met most of the list


def test_chunk_sizes_are_the_grid_s_multiples_within_the_step_and_always_one_step() -> None:
    assert chunk_sizes(256, 2048) == [256, 512, 768, 1024, 1536, 2048]
    assert chunk_sizes(256, 1000) == [256, 512, 768]
    assert chunk_sizes(256, 100) == [256]  # a chunk asked for less still computes a whole step
    assert grid_shapes(0, 2048, 4096) == []
    keys = [s.keys for s in grid_shapes(256, 2048, 8192)]
    assert keys == sorted(keys) and max(keys) == 8192 and len(keys) == 174


def test_a_real_model_warms_a_shape_on_the_cpu() -> None:
    model = load(str(tiny_model(LLAMA)))[0]
    warmer = PlanWarmer(model, GRID)
    for shape in (ChunkShape(0, 256), ChunkShape(512, 768)):
        warmer.warm(shape)


@pytest.fixture
def prefill_only_cudnn():
    """The decode layout on, as the lease thread turns it on under prefill-only cuDNN (CUDA only otherwise)."""
    decode_layout.set_active(True)
    try:
        yield
    finally:
        decode_layout.set_active(False)


def test_plans_are_listed_only_under_prefill_only_cudnn_with_the_grid_on_plain_caches(prefill_only_cudnn) -> None:
    llama, swa = load(str(tiny_model(LLAMA)))[0], load(str(tiny_model(LLAMA_SWA)))[0]
    warmer, shapes = plan_list(llama, GRID, STEP, 1024)
    assert warmer is not None and shapes == grid_shapes(GRID, STEP, 1024)
    assert plan_list(llama, 0, STEP, 1024) == (None, [])  # the grid off
    assert plan_list(swa, GRID, STEP, 1024) == (None, [])  # a sliding window keeps mlx-lm's chunks
    decode_layout.set_active(False)
    assert plan_list(llama, GRID, STEP, 1024) == (None, [])  # MLX's kernels (or the CPU): no cuDNN plans


def test_under_prefill_only_cudnn_any_start_and_snapshot_split_keep_every_chunk_a_warmed_shape(
        prefill_only_cudnn) -> None:
    """A cache hit at any offset, its buffer any length, a snapshot boundary anywhere: every chunk is listed."""
    model = RecordingModel()
    warmer = PlanWarmer(model, GRID)
    warmed = {call for shape in grid_shapes(GRID, STEP, MAX_KEYS) for call in _warm_calls(model, warmer, shape)}
    rng = random.Random(1)
    for _ in range(150):
        prompt = rng.randint(2, MAX_KEYS + 1 - 512)  # as above: a padded last chunk ends within 511 past it
        start = rng.randint(0, prompt - 1)
        caches = make_prompt_cache(model)
        if start:
            buffer = mx.zeros((1, 2, start + rng.choice([0, 8, 100, 256, 300]), 8), mx.float16)
            for c in caches:
                c.keys, c.values, c.offset = buffer, buffer, start
        split = rng.randint(start + 1, prompt) if rng.random() < 0.5 and start + 1 < prompt else None
        prefill = ChunkedPrefill(model, caches, [1] * prompt, STEP, start=start, split_at=split, grid=GRID)
        assert prefill.fed == start // GRID * GRID
        model.take_calls()
        while prefill.remaining:
            prefill.chunk(rng.choice([None, rng.randint(1, STEP)]))
        assert {call for call in model.take_calls() if call.queries > 1} <= warmed


def test_under_prefill_only_cudnn_a_row_from_a_cache_hit_recomputes_back_to_the_grid_and_ends_the_same(
        prefill_only_cudnn) -> None:
    model = load(str(tiny_model(LLAMA)))[0]
    prompt = [(7 * j) % 500 + 3 for j in range(900)]
    caches = make_prompt_cache(model)
    model(mx.array(prompt[:300])[None], cache=caches)
    hit = CacheHit(cache_clone.entry(prompt[:300], caches), 300)
    row = SoloRow(model, "r", prompt, SamplingParams(max_tokens=2), hit=hit, prefill_grid=GRID)
    assert row.cached_tokens == 256  # stepped back to the grid point below the hit
    listed = {(s.tokens, s.keys) for s in grid_shapes(GRID, STEP, 1024)}
    while row.prefill_remaining:
        row.prefill_chunk(256)
        assert row.last_chunk_shape in listed and row.caches[0].keys.shape[2] == row.last_chunk_shape[1]
    row.first_token()
    plain = SoloRow(model, "p", prompt, SamplingParams(max_tokens=2), prefill_grid=0)
    while plain.prefill_remaining:
        plain.prefill_chunk()
    plain.first_token()
    assert row.token0 == plain.token0
    for a, b in zip(row.caches, plain.caches, strict=True):
        assert a.offset == b.offset
        np.testing.assert_allclose(np.array(a.keys[..., :a.offset, :]), np.array(b.keys[..., :b.offset, :]),
                                   atol=2e-2, rtol=2e-2)
