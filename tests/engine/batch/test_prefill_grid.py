"""The prefill shape grid: chunks end on grid points, a short tail is padded and trimmed, and the row is unchanged.

engine/batch/chunked_prefill.py: on a GPU, cuDNN builds a plan per attention
shape; on the grid, prompts reuse a few. Here (CPU) the grid is forced on,
and every row must end where mlx-lm's chunks leave it: the same KV (to
float tolerance: the chunks differ) and the same greedy tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm import load

from mlx_trio import open_engine
from mlx_trio.engine.batch.chunked_prefill import GRID_MULTIPLES, grid_chunk, resolve_grid
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model
from tests.prompts import complete_together

GREEDY = SamplingParams(max_tokens=8)


def _prompt(salt: int, n: int) -> list[int]:
    return [(13 * salt + 7 * j) % 500 + 3 for j in range(n)]


@given(st.integers(0, 5000), st.integers(1, 3000), st.sampled_from([16, 32, 256]))
def test_a_grid_chunk_ends_on_the_grid_and_never_takes_more_than_asked(fed: int, n: int, grid: int) -> None:
    take, pad = grid_chunk(fed, n, grid)
    assert 0 < take <= n and pad >= 0
    if fed % grid:  # off the grid: to the next grid point, unpadded
        assert pad == 0 and (fed + take) % grid == 0 or take == n
    else:  # on it: whole steps from the fixed set, or one padded step
        assert (take + pad) % grid == 0 and (fed + take + pad) % grid == 0
        assert (take + pad) // grid in GRID_MULTIPLES
        assert pad == 0 or take == n < grid


def test_the_grid_is_off_on_the_cpu_unless_asked() -> None:
    assert resolve_grid(None) == (256 if mx.default_device() == mx.gpu else 0)
    assert resolve_grid(0) == 0 and resolve_grid(64) == 64


def _run(model, prompt: list[int], *, grid: int, limit: int | None, hit=None) -> tuple[SoloRow, list[int]]:
    row = SoloRow(model, "r", prompt, GREEDY, hit=hit, prefill_grid=grid)
    ends = []
    while row.prefill_remaining:
        row.prefill_chunk(limit)
        ends.append(row.fed)
    row.first_token()
    return row, ends


def _kv(row: SoloRow) -> list[np.ndarray]:
    return [np.array(a.astype(mx.float32)) for c in row.caches for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])]


@pytest.mark.parametrize("length,limit", [(100, 40), (77, None), (20, 64), (130, 100)])
def test_a_gridded_prefill_leaves_the_row_where_mlx_lm_chunks_leave_it(length: int, limit: int | None) -> None:
    model = load(str(tiny_model(LLAMA)))[0]
    prompt = _prompt(length, length)
    plain, _ = _run(model, prompt, grid=0, limit=limit)
    gridded, ends = _run(model, prompt, grid=16, limit=limit)
    assert all(e % 16 == 0 for e in ends[:-1])  # every chunk but the tail ends on the grid
    assert ends[-1] == length - 1 == gridded.caches[0].offset - 1  # the padding was trimmed
    for a, b in zip(_kv(plain), _kv(gridded), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)
    assert plain.token0 == gridded.token0


def test_a_chunk_asked_for_less_than_a_grid_step_takes_a_whole_one_and_stays_on_the_grid() -> None:
    """A small limit (a chunk sizer that expects costly chunks) must not pad each chunk and walk off the grid:
    every chunk but the tail is a whole step of real tokens, and the row ends as mlx-lm's chunks leave it."""
    model = load(str(tiny_model(LLAMA)))[0]
    prompt = _prompt(3, 100)
    plain, _ = _run(model, prompt, grid=0, limit=4)
    gridded, ends = _run(model, prompt, grid=16, limit=4)
    # 16 real tokens a chunk although 4 were asked; the last 19 in one padded 32-token chunk (within twice a step)
    assert ends == [16, 32, 48, 64, 80, 99]
    assert gridded.caches[0].offset == 100
    for a, b in zip(_kv(plain), _kv(gridded), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)
    assert plain.token0 == gridded.token0


def test_after_an_off_grid_start_a_small_chunk_goes_to_the_next_grid_point() -> None:
    model = load(str(tiny_model(LLAMA)))[0]
    prompt = _prompt(4, 60)
    row = SoloRow(model, "r", prompt, GREEDY, prefill_grid=16)
    row.prefill_chunk(5)  # on the grid at 0: a whole step
    assert row.fed == 16


def test_a_sliding_window_model_keeps_mlx_lm_chunks_on_the_grid() -> None:
    """A dummy token would enter a rotating window's state: the grid stays off for such caches."""
    model = load(str(tiny_model(LLAMA_SWA)))[0]
    prompt = _prompt(3, 50)
    _, plain = _run(model, prompt, grid=0, limit=24)
    _, gridded = _run(model, prompt, grid=16, limit=24)
    assert gridded == plain


async def test_an_engine_on_the_grid_streams_the_same_tokens_while_rows_decode_and_prompts_prefill() -> None:
    """`prefill_grid` reaches every row: busy (sized) chunks on the grid, the same greedy tokens as off it."""
    prompts = [_prompt(i, n) for i, n in enumerate((150, 37, 90, 300))]
    results: dict[int, dict[int, list[int]]] = {}
    for grid in (0, 16):
        async with open_engine(str(tiny_model(LLAMA)), batch=4, prefill_step_size=64, prefill_grid=grid) as engine:
            results[grid] = await complete_together(engine, prompts, 6)
            assert engine.actors.lane.prefill.statistics().chunks > len(prompts)  # prompts ran in several chunks
    assert results[16] == results[0]


def test_after_an_off_grid_start_the_buffers_end_where_the_chunks_end() -> None:
    """cuDNN plans by the keys' strides too: from a cache hit at any offset, with a buffer of any length,
    every later grid chunk leaves the buffer ending exactly at its end (mlx-lm's growth alone would keep
    it off the grid for the rest of the prompt), with the same KV."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_trio.engine.batch.chunked_prefill import ChunkedPrefill

    model = load(str(tiny_model(LLAMA)))[0]
    prompt = _prompt(9, 2400)

    def cut_at(start: int) -> list:
        caches = make_prompt_cache(model)
        model(mx.array(prompt[:start])[None], cache=caches)
        for c in caches:  # as a prompt-cache clone holds it: exactly its tokens
            c.keys, c.values = c.keys[..., :start, :], c.values[..., :start, :]
        mx.eval([c.state for c in caches])
        return caches

    caches = cut_at(300)
    prefill = ChunkedPrefill(model, caches, prompt, 2048, start=300, grid=256)
    ends = []
    while prefill.chunk(512) is not None:
        ends.append((prefill.fed, caches[0].keys.shape[2]))
    assert ends[0] == (512, 556)  # the off-grid chunk: mlx-lm's growth from 300
    assert all(fed == length for fed, length in ends[1:-1]) and len(ends) > 2, ends
    plain = cut_at(300)
    reference = ChunkedPrefill(model, plain, prompt, 2048, start=300, grid=0)
    while reference.chunk(2048) is not None:
        pass
    for a, b in zip(caches, plain, strict=True):
        assert a.offset == b.offset
        np.testing.assert_allclose(np.array(a.keys[..., :a.offset, :]), np.array(b.keys[..., :b.offset, :]),
                                   atol=2e-2, rtol=2e-2)


@given(st.integers(0, 40).map(lambda k: 16 * k), st.integers(1, 600), st.integers(1, 600))
def test_a_rest_that_a_listed_chunk_holds_within_twice_the_ask_goes_in_one_padded_chunk(fed: int, n: int,
                                                                                     rest: int) -> None:
    take, pad = grid_chunk(fed, n, 16, rest=rest, cap=512)
    whole = min((m * 16 for m in GRID_MULTIPLES if m * 16 >= rest), default=None)
    if whole is not None and whole <= min(2 * n, 512):
        assert (take, pad) == (rest, whole - rest)
    else:
        assert (take, pad) == grid_chunk(fed, n, 16)


def test_a_prompt_whose_rest_fits_one_listed_chunk_prefills_in_one_padded_forward() -> None:
    """39 tokens to prefill on a 16-token grid: one chunk of 48 (9 dummy tokens) instead of 32 and a padded 7,
    and the row ends where mlx-lm's chunks leave it."""
    model = load(str(tiny_model(LLAMA)))[0]
    prompt = _prompt(5, 40)
    plain, _ = _run(model, prompt, grid=0, limit=None)
    gridded, ends = _run(model, prompt, grid=16, limit=None)
    assert ends == [39] and gridded.last_chunk_shape == (48, 48)
    assert gridded.caches[0].offset == 40
    for a, b in zip(_kv(plain), _kv(gridded), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)
    assert plain.token0 == gridded.token0
