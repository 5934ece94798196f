"""Scaled dot-product attention as plain MLX ops: what MLX computes where it has no fused kernel.

`mx.fast.scaled_dot_product_attention` with an array mask and more than one
query runs on MLX's CUDA backend either on cuDNN (under prefill-only cuDNN,
docs/design.md §4.6: a plan per new shape, 60-90 ms to build on an H200) or,
without it, on MLX's own fallback. `unfused_attention` is that fallback written
out (mlx 0.32's `fast.cpp`: queries scaled first, grouped heads by expansion,
a boolean mask as `where(mask, scores, finfo.min)`, an additive one added,
softmax in float32 precision, then the values), so it computes exactly what
MLX's CPU backend computes for the same call (tests/engine/attention/
test_unfused_attention.py) and never meets a cuDNN plan. The routed attention
sends a cohort's shared prefill forwards here under prefill-only cuDNN
(engine/attention/routed_attention.py, `CohortKVCache`): short prompts whose
scores (rows × heads × queries × keys) stay small. Lease thread only.
"""

from __future__ import annotations

import mlx.core as mx


def unfused_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: mx.array | str | None) -> mx.array:
    """`[B, H, L, D]` queries over `[B, Hkv, T, D]` keys/values (H a multiple of Hkv); `mask` as MLX's sdpa takes it."""
    q = queries * mx.array(scale, dtype=queries.dtype)
    B, n_heads, L, _ = q.shape
    n_kv_heads = keys.shape[1]
    repeats = n_heads // n_kv_heads
    k, v = keys, values
    if repeats > 1:
        q = q.reshape(B, n_kv_heads, repeats, L, -1)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ mx.swapaxes(k, -1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        T = k.shape[-2]
        mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
    if mask is not None:
        if repeats > 1 and mask.ndim >= 3:  # the grouped heads' axis, as the scores have it
            if mask.shape[-3] == 1:
                mask = mx.expand_dims(mask, -3)
            else:
                mask = mask.reshape(*mask.shape[:-3], n_kv_heads, repeats, *mask.shape[-2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = scores @ v
    if repeats > 1:
        out = out.reshape(B, n_heads, L, -1)
    return out
