"""The ragged decode attention's pure-MLX reference and the kernel's host-side rules (the kernel itself needs CUDA)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from mlx_trio.engine.attention import ragged_kernel
from mlx_trio.engine.attention.ragged_reference import reference_decode_attention


def _case(B: int, H: int, Hkv: int, T: int, D: int, dtype: mx.Dtype, seed: int) -> tuple[mx.array, ...]:
    kq, kk, kv, ks = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((B, H, 1, D), key=kq).astype(dtype)
    # The keys as a cache holds them: a slice of a longer buffer.
    k = mx.random.normal((B, Hkv, T + 40, D), key=kk).astype(dtype)[..., :T, :]
    v = mx.random.normal((B, Hkv, T + 40, D), key=kv).astype(dtype)[..., :T, :]
    start = mx.random.randint(0, T, (B,), key=ks).astype(mx.int32)
    return q, k, v, start


@pytest.mark.parametrize(("B", "H", "Hkv", "T", "D", "dtype"), [
    (1, 4, 4, 9, 16, mx.float32), (3, 8, 2, 70, 64, mx.float32), (5, 32, 8, 300, 64, mx.bfloat16),
    (2, 32, 8, 129, 128, mx.float16)])
def test_reference_equals_sdpa_with_the_caches_mask(B: int, H: int, Hkv: int, T: int, D: int, dtype: mx.Dtype) -> None:
    """The positions kept are mlx-lm's left-padding mask for one query; the values MLX's masked attention's."""
    q, k, v, start = _case(B, H, Hkv, T, D, dtype, seed=T)
    mask = create_causal_mask(1, offset=T - 1, left_padding=start)  # BatchKVCache.make_mask before the update
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
    got = reference_decode_attention(q, k, v, start, D**-0.5)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() <= tol


def test_reference_ignores_the_padding_values() -> None:
    """Whatever a row's padded positions hold (a dead slot's junk), its output is the same."""
    q, k, v, start = _case(2, 4, 2, 12, 16, mx.float32, seed=1)
    start = mx.array([5, 0], dtype=mx.int32)
    junk = mx.concatenate([mx.full((1, 2, 5, 16), 1e4), k[:1, :, 5:]], axis=2)
    got = reference_decode_attention(q, mx.concatenate([junk, k[1:]]), v, start, 0.25)
    assert mx.array_equal(got, reference_decode_attention(q, k, v, start, 0.25))
    assert not mx.array_equal(got, reference_decode_attention(q, k, v, mx.zeros_like(start), 0.25))


def test_supports_only_what_the_kernel_computes() -> None:
    q, k, v, _ = _case(2, 8, 2, 20, 64, mx.bfloat16, seed=2)
    assert ragged_kernel.supports(q, k, v)
    assert not ragged_kernel.supports(mx.concatenate([q, q], axis=2), k, v)  # two queries: a verify forward
    assert not ragged_kernel.supports(q.astype(mx.float32), k, v)  # mixed dtypes
    assert not ragged_kernel.supports(q[..., :40], k[..., :40], v[..., :40])  # D not a multiple of 16
    assert not ragged_kernel.supports(q[:, :7], k, v)  # 7 query heads over 2 kv heads
    assert ragged_kernel.supports(q[:, :6], k, v)  # 3 per kv head
    wide = mx.zeros((1, 32, 1, 128), mx.bfloat16), mx.zeros((1, 2, 8, 128), mx.bfloat16)
    assert not ragged_kernel.supports(wide[0], wide[1], wide[1])  # 16 heads per kv head at D=128: too many registers
    assert not ragged_kernel.supports(q.astype(mx.int32), k.astype(mx.int32), v.astype(mx.int32))


@pytest.mark.parametrize(("rows", "kv_heads", "keys", "splits"), [
    (1, 8, 10_000, 64), (1, 8, 256, 4), (64, 8, 256, 1), (64, 8, 10_000, 10), (8, 8, 2048, 8), (1, 1, 10, 1)])
def test_splits_fill_the_gpu_without_tiny_chunks(rows: int, kv_heads: int, keys: int, splits: int) -> None:
    assert ragged_kernel.splits_for(rows, kv_heads, keys) == splits
