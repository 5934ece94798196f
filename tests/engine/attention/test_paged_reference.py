"""Attention over block tables equals mlx-lm's dense attention over the same K/V, row by row (per-row lengths)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.base import scaled_dot_product_attention

from mlx_trio.engine.attention.paged_attention import bounded
from mlx_trio.engine.attention.paged_reference import reference_paged_attention


def _case(lengths: list[int], L: int, block_size: int, heads: int, kv_heads: int, seed: int) -> tuple:
    """Random K/V per row scattered into shuffled blocks of one pool; each row's queries for its last L positions."""
    D = 8
    rng = np.random.default_rng(seed)
    per_row = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_row) + 3  # some blocks nobody owns (junk, never read)
    order = rng.permutation(num_blocks)
    pool_k = rng.standard_normal((num_blocks, block_size, kv_heads, D)).astype(np.float32)
    pool_v = rng.standard_normal((num_blocks, block_size, kv_heads, D)).astype(np.float32)
    tables, dense, start = [], [], 0
    for n, nb in zip(lengths, per_row):
        blocks = [int(b) for b in order[start : start + nb]]
        start += nb
        k = rng.standard_normal((kv_heads, n, D)).astype(np.float32)
        v = rng.standard_normal((kv_heads, n, D)).astype(np.float32)
        for p in range(n):
            pool_k[blocks[p // block_size], p % block_size] = k[:, p]
            pool_v[blocks[p // block_size], p % block_size] = v[:, p]
        tables.append(blocks)
        dense.append((k, v))
    width = max(per_row)
    table = mx.array([t + [order[-1].item()] * (width - len(t)) for t in tables], dtype=mx.int32)
    q = mx.array(rng.standard_normal((len(lengths), heads, L, D)).astype(np.float32))
    return q, mx.array(pool_k), mx.array(pool_v), table, dense


@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=5), L=st.integers(1, 6),
       block_size=st.sampled_from([1, 4, 16, 32]), gqa=st.sampled_from([(4, 2), (4, 4), (6, 1)]),
       seed=st.integers(0, 2**31))
def test_paged_attention_equals_mlx_lm_dense_attention_per_row(lengths, L, block_size, gqa, seed) -> None:
    lengths = [max(n, L) for n in lengths]  # a row's queries are among its positions
    heads, kv_heads = gqa
    q, pool_k, pool_v, table, dense = _case(lengths, L, block_size, heads, kv_heads, seed)
    scale = 8**-0.5
    got = reference_paged_attention(q, pool_k, pool_v, table, mx.array(lengths), scale)
    for b, (k, v) in enumerate(dense):
        mask = "causal" if L > 1 else None  # mlx-lm's own: queries are the last L of the keys
        want = scaled_dot_product_attention(q[b : b + 1], mx.array(k)[None], mx.array(v)[None], cache=None,
                                            scale=scale, mask=mask)
        assert mx.allclose(got[b : b + 1], want, atol=1e-5, rtol=1e-5).item(), (b, lengths, L)


def test_keys_past_a_rows_length_are_never_read() -> None:
    """Poisoning every position past each row's length (junk, inf) changes nothing."""
    q, pool_k, pool_v, table, dense = _case([5, 19], 1, 8, 4, 2, 0)
    lengths = mx.array([5, 19])
    want = reference_paged_attention(q, pool_k, pool_v, table, lengths, 0.3)
    k, v = np.array(pool_k), np.array(pool_v)
    t = np.array(table)
    for b, n in enumerate([5, 19]):
        for p in range(n, t.shape[1] * 8):
            k[t[b, p // 8], p % 8] = 1e30
    got = reference_paged_attention(q, mx.array(k), mx.array(v), table, lengths, 0.3)
    assert mx.array_equal(got, want).item()


@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=5), L=st.integers(1, 9),
       block_size=st.sampled_from([1, 4, 16]), limit=st.sampled_from([1, 4000, 20000, 1 << 30]),
       seed=st.integers(0, 2**31))
def test_bounded_pieces_equal_one_call(lengths, L, block_size, limit, seed) -> None:
    """Rows and queries attended in pieces under a transient limit give what one call gives."""
    lengths = [max(n, L) for n in lengths]
    q, pool_k, pool_v, table, _ = _case(lengths, L, block_size, 4, 2, seed)
    want = reference_paged_attention(q, pool_k, pool_v, table, mx.array(lengths), 0.3)
    got = bounded(q, pool_k, pool_v, table, mx.array(lengths), 0.3, limit=limit)
    assert mx.allclose(got, want, atol=1e-6, rtol=1e-6).item()
