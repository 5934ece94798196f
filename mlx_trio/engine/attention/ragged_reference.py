"""The ragged decode attention in plain MLX ops: what the CUDA kernel computes, on any device.

The kernel (engine/attention/ragged_kernel.py) cannot run on the CPU, so the
routing's tests and `benchmarks/ragged_attention.py --tiny` route the calls
here instead (`RaggedRoute.attend`). Each row's scores are computed in float32
over all `T` keys, the positions before the row's `start` set to -inf, softmaxed
and applied to the values: the same result as the kernel up to summation order,
and the same positions as mlx-lm's left-padding mask.
"""

from __future__ import annotations

import mlx.core as mx


def reference_decode_attention(queries: mx.array, keys: mx.array, values: mx.array, start: mx.array,
                               scale: float) -> mx.array:
    """softmax(scale * q k^T) v over each row's keys `start[b] <= j < T`; `[B, H, 1, D]` in the queries' dtype."""
    B, H, _, D = queries.shape
    kv_heads, n_keys = keys.shape[1], keys.shape[2]
    q = queries.astype(mx.float32).reshape(B, kv_heads, H // kv_heads, D) * scale
    scores = q @ keys.astype(mx.float32).swapaxes(-1, -2)  # [B, Hkv, G, T]
    own = (mx.arange(n_keys)[None] >= start.astype(mx.int32)[:, None])[:, None, None, :]
    scores = mx.where(own, scores, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ values.astype(mx.float32)
    return out.reshape(B, H, 1, D).astype(queries.dtype)
