"""`unfused_attention` computes exactly what MLX's own attention computes where it has no fused kernel (the CPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_trio.engine.attention.unfused_attention import unfused_attention

SHAPES = [(3, 8, 2, 5, 9), (2, 4, 4, 7, 7), (1, 8, 8, 1, 12), (4, 8, 2, 1, 6), (2, 8, 2, 9, 9)]  # B, H, Hkv, L, T


def _inputs(dtype: mx.Dtype, B: int, H: int, Hkv: int, L: int, T: int) -> tuple[mx.array, ...]:
    mx.random.seed(B * 1000 + H * 100 + L * 10 + T)
    q, k, v = (mx.random.normal(shape).astype(dtype) for shape in ((B, H, L, 16), (B, Hkv, T, 16), (B, Hkv, T, 16)))
    last = mx.arange(T) == T - 1  # every query keeps a key
    shared = mx.logical_or(mx.random.uniform(shape=(B, 1, L, T)) > 0.3, last)
    per_head = mx.logical_or(mx.random.uniform(shape=(B, H, L, T)) > 0.3, last)
    return q, k, v, shared, per_head


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "per-head", "causal"])
def test_unfused_attention_is_mlx_attention_bit_for_bit(dtype: mx.Dtype, shape: tuple[int, ...], mask_kind: str) -> None:
    q, k, v, shared, per_head = _inputs(dtype, *shape)
    mask = {"none": None, "bool": shared, "additive": mx.where(shared, 0.0, -1e9).astype(dtype),
            "per-head": per_head, "causal": "causal"}[mask_kind]
    got = unfused_attention(q, k, v, 0.25, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.array_equal(got, want).item()


def test_an_unknown_mask_name_is_refused() -> None:
    q, k, v, _, _ = _inputs(mx.float32, 1, 2, 2, 3, 3)
    with pytest.raises(ValueError, match="unknown attention mask"):
        unfused_attention(q, k, v, 0.25, "sliding")
