"""A paged row's prefill on the shape grid (engine/batch/chunked_prefill.py): the padded layout's chunk shapes.

Here (CPU) the grid is forced on. A paged row must walk the chunks a padded row
walks, end where it ends (KV and token 0), never write, key or hold its dummy
tokens, and under prefill-only cuDNN lead a chunk that starts off the grid
from the grid point below, keeping its (shared) blocks; the pool is idle after every test.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load

from mlx_trio.engine.attention import paged_layout, routed_attention
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv import decode_layout
from mlx_trio.engine.kv.blocks.chain import chain_keys
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

GREEDY = SamplingParams(max_tokens=4)


@cache
def _model() -> nn.Module:
    model = load(str(tiny_model(LLAMA)))[0]
    routed_attention.install(model)
    return model


def _kv(block_size: int = 16, num_blocks: int = 256) -> PagedKV:
    model = _model()
    shapes = paged_layout.layer_shapes(model)
    budget = num_blocks * paged_layout.BlockStorage.block_bytes(shapes, block_size, mx.float32)
    return paged_layout.paged_kv_for(model, budget, "tiny-grid", block_size=block_size)


def _prompt(salt: int, n: int) -> list[int]:
    return [(13 * salt + 7 * j + j * j) % 500 + 3 for j in range(n)]


def _run(prompt: list[int], *, grid: int, limit: int | None, kv: PagedKV | None = None,
         step: int = 2048) -> tuple[SoloRow, list[tuple[int, tuple[int, int] | None]]]:
    row = SoloRow(_model(), "r", prompt, GREEDY, paged=kv, prefill_grid=grid, prefill_step_size=step)
    chunks = []
    while row.prefill_remaining:
        row.prefill_chunk(limit)
        chunks.append((row.fed, row.last_chunk_shape))
    row.first_token()
    return row, chunks


def _paged_kv_of(row: SoloRow) -> list[np.ndarray]:
    assert row.paged_kv is not None and row.paged_row is not None
    caches = row.paged_kv.extract(row.paged_row)
    return [np.array(a) for c in caches for a in (c.keys, c.values)]


def _padded_kv_of(row: SoloRow) -> list[np.ndarray]:
    return [np.array(a[..., : c.offset, :]) for c in row.caches for a in (c.keys, c.values)]


@contextmanager
def _prefill_only_cudnn() -> Iterator[None]:
    """What the lease thread sets under MLX_TRIO_ATTENTION_BACKEND=cudnn-prefill (CPU: only the layout rules)."""
    decode_layout.set_active(True)
    try:
        yield
    finally:
        decode_layout.set_active(False)


@pytest.mark.parametrize("length,limit,step", [(300, None, 128), (100, 40, 2048), (77, None, 2048),
                                               (20, 64, 2048), (130, 100, 64), (513, 48, 256)])
def test_a_paged_row_on_the_grid_walks_the_padded_rows_chunks_and_ends_with_its_kv(length, limit, step) -> None:
    prompt = _prompt(length, length)
    padded, padded_chunks = _run(prompt, grid=32, limit=limit, step=step)
    kv = _kv()
    paged, paged_chunks = _run(prompt, grid=32, limit=limit, kv=kv, step=step)
    assert paged_chunks == padded_chunks  # the same shapes: (tokens computed, keys), dummy tokens included
    assert all(fed % 32 == 0 for fed, _ in paged_chunks[:-1])
    row = paged.paged_row
    assert row is not None and row.length == length and len(row.blocks) == -(-length // 16)
    for a, b in zip(_padded_kv_of(padded), _paged_kv_of(paged), strict=True):
        np.testing.assert_array_equal(a, b)  # the same chunks and the same attention call: the same bits
    assert paged.token0 == padded.token0
    paged.close()
    kv.pool.check()
    assert kv.pool.idle


def test_dummy_tokens_are_never_written_keyed_or_held() -> None:
    """39 tokens in one 64-token chunk (25 dummies), into a pool poisoned with NaN: only the row's 39 positions
    are written (no dummy's KV, no block for one), the row holds 3 blocks (2 full ones keyed by the prompt's own
    tokens), and a sibling with the same prompt finds only those."""
    kv = _kv()
    for arrays in (kv.storage.keys, kv.storage.values):
        for layer in range(len(arrays)):
            arrays[layer] = mx.full(arrays[layer].shape, mx.nan, arrays[layer].dtype)
    prompt = _prompt(5, 40)
    row = SoloRow(_model(), "r", prompt, GREEDY, paged=kv, prefill_grid=32)
    assert row.prefill_chunk() == 0 and row.last_chunk_shape == (64, 64)
    paged = row.paged_row
    assert paged is not None and paged.length == 39 and len(paged.blocks) == 3
    for layer in [*kv.storage.keys, *kv.storage.values]:
        blocks = np.array(layer)
        assert not np.isnan(blocks[paged.blocks[:2]]).any() and not np.isnan(blocks[paged.blocks[2], :7]).any()
        assert np.isnan(blocks[paged.blocks[2], 7:]).all()  # past the row's 39 positions: never written
        others = [b for b in range(blocks.shape[0]) if b not in paged.blocks]
        assert np.isnan(blocks[others]).all()  # no block was allocated or written for a dummy token
    assert paged.keys == chain_keys(paged.root, prompt, 16)[:2]
    sibling = SoloRow(_model(), "s", prompt, GREEDY, paged=kv, prefill_grid=32)
    assert sibling.cached_tokens == 32
    sibling.close()
    row.close()
    kv.pool.check()
    assert kv.pool.idle


def _blocks_of(kv: PagedKV, blocks: list[int]) -> list[np.ndarray]:
    index = mx.array(blocks)
    return [np.array(a[index]) for a in [*kv.storage.keys, *kv.storage.values]]


def test_under_prefill_only_cudnn_a_cached_prefix_off_the_grid_leads_the_next_chunk_from_the_grid_point() -> None:
    """A row that finds 3 shared blocks (48 tokens) keeps them all: its first chunk feeds tokens 32..47 again as
    queries (not written), so it is a listed grid shape; the shared blocks are unchanged, nothing is copied
    or allocated for the lead, tokens as alone, pool idle."""
    kv = _kv()
    prompt = _prompt(8, 90)
    first, _ = _run(prompt[:50], grid=32, limit=None, kv=kv)
    assert first.paged_row is not None
    shared = first.paged_row.blocks[:3]
    before = _blocks_of(kv, shared)
    reused = kv.reused_tokens
    with _prefill_only_cudnn():
        row, chunks = _run(prompt, grid=32, limit=32, kv=kv)
    assert row.paged_row is not None and row.paged_row.blocks[:3] == shared and kv.stats().shared == 3
    assert len(row.paged_row.blocks) == -(-90 // 16)
    assert row.cached_tokens == 48 and kv.reused_tokens == reused + 48
    assert [shape for _, shape in chunks] == [(64, 96)]  # 16 again + the 41 left + 7 dummies, keys to 96
    for a, b in zip(before, _blocks_of(kv, shared), strict=True):
        np.testing.assert_array_equal(a, b)
    alone, _ = _run(prompt, grid=0, limit=None)
    assert row.token0 == alone.token0
    row.close()
    first.close()
    kv.pool.check()
    assert kv.pool.idle


def test_under_prefill_only_cudnn_a_catch_up_off_the_grid_keeps_the_blocks_and_the_grid() -> None:
    """Blocks a sibling cached past a grid point are all taken, and the next chunk leads from that grid point:
    every chunk is a listed shape."""
    kv = _kv()
    prompt = _prompt(9, 300)
    with _prefill_only_cudnn():
        row = SoloRow(_model(), "r", prompt, GREEDY, paged=kv, prefill_grid=32)
        other, _ = _run(prompt[:60] + [7] * 5, grid=32, limit=None, kv=kv)  # caches 3 blocks (48 tokens)
        row.prefill_chunk(32)  # catches up 48; computes 48..64 after feeding 32..48 again
        assert row.cached_tokens == 48 and row.fed == 64 and row.last_chunk_shape == (32, 64)
        while row.prefill_remaining:
            row.prefill_chunk(32)
            assert row.last_chunk_shape is not None and row.last_chunk_shape[1] % 32 == 0
        row.first_token()
    alone, _ = _run(prompt, grid=0, limit=None)
    assert row.token0 == alone.token0
    for a, b in zip(_padded_kv_of(alone), _paged_kv_of(row), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)  # other chunks than alone's: to float tolerance
    row.close()
    other.close()
    kv.pool.check()
    assert kv.pool.idle


def test_a_grid_that_is_not_a_multiple_of_the_block_size_stays_off_for_a_paged_row() -> None:
    kv = _kv(block_size=16)
    row, chunks = _run(_prompt(2, 70), grid=24, limit=30, kv=kv)
    assert all(shape is None for _, shape in chunks)
    row.close()
    assert kv.pool.idle


@pytest.mark.slow
def test_the_prefill_benchmark_part_runs_on_the_cpu_and_finds_the_first_tokens_equal() -> None:
    """benchmarks/paged_kv.py --parts prefill, the tiny llama, on a forced grid (exit 1 if the tokens differ)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "benchmarks/paged_kv.py", "--parts", "prefill", "--prefill-tokens", "300",
                          "--prefill-grid", "64", "--prefill-limits", "0,64", "--prefill-runs", "2"],
                         capture_output=True, text=True, env=os.environ, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("first tokens equal") == 2, out.stdout


async def test_a_paged_engine_on_the_grid_streams_the_padded_engines_tokens() -> None:
    """Through the prefill actor (busy chunks sized while rows decode, siblings sharing a prefix): --kv-layout paged on a
    16-token grid gives every request the tokens the padded layout gives on the same grid."""
    from mlx_trio import open_engine
    from tests.prompts import complete_together

    common = _prompt(1, 70)
    prompts = [_prompt(i, n) for i, n in enumerate((150, 37, 90, 300))] + [common + _prompt(9, 20),
                                                                          common + _prompt(10, 33)]
    results: dict[bool, dict[int, list[int]]] = {}
    for paged in (False, True):
        async with open_engine(str(tiny_model(LLAMA)), batch=4, prefill_step_size=64, prefill_grid=16,
                               kv_layout="paged" if paged else "padded", kv_budget_bytes=16 << 20) as engine:
            results[paged] = await complete_together(engine, prompts, 6)
    assert results[True] == results[False]
