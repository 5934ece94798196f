"""Whether this backend attends over quantized KV, and correctly: mlx-lm's quantized SDPA on attention's shapes.

mlx-lm's attention over a quantized cache (`quantized_scaled_dot_product_attention`,
`models/base.py`) is two `mx.quantized_matmul`s: scores = q @ K^T
(`transpose=True`: M = query length, N = key length, K = head_dim) and
out = scores @ V (`transpose=False`: N = head_dim, K = key length). With
grouped-query attention it reshapes the queries to (B, kv_heads, repeats,
L, D) and gives the keys and values a size-1 repeat axis, which
`quantized_matmul` broadcasts.

What MLX's CUDA backend needs (read in its source at 0.32.2,
mlx/backend/cuda/quantized/quantized.cpp and qmm/qmm.cu; the H200 runs
0.32.4): every kernel (qmm_sm90, qmm_sm80, qmm_naive, qmv) requires the
packed matrix, its scales and biases to be *contiguous*
(`flags().contiguous`, row-contiguous last two dims), and only
`qmm_naive` takes `transpose=False`. A cache hands attention
`buffer[..., :offset, :]` of a buffer preallocated in 256-position steps,
which is not contiguous unless offset is the buffer's size: then no kernel
accepts it, "No implementation for problem shape", whatever the bits,
group size or head dimension (the shapes in the message are not the
cause). When the buffer happens to be full the slice is contiguous, but
the GQA broadcast is then read wrongly: the kernels know only a fully
batched matrix or one shared by every batch (`broadcast_b` = size !=
data_size), so every head would attend over the first head's keys.
The probe below therefore checks both layouts a cache produces
(`sliced`, `whole`) for errors and for wrong values, against
`mx.fast.scaled_dot_product_attention` over the dequantized keys and
values. `folded` (repeats folded into the query axis, no broadcast) is the
formulation those kernels would run right on whole buffers; mlx-lm does
not use it, and the engine does not patch mlx-lm, so it is measured
(benchmarks/kv_quant.py), not served.

Lease thread only (it evaluates MLX arrays).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, make_prompt_cache

# A quantized cache's buffers grow in steps of this many positions (mlx-lm's `QuantizedKVCache.step`).
_STEP = 256
# Max error between quantized attention and float32 SDPA over the same (dequantized) values, relative to
# the largest output: the CPU backend's bf16 accumulations reach ~0.1 here; attending over another head's
# or row's values gives ~1 (see `probe`'s values).
_TOLERANCE = 0.3

Attention = Callable[..., mx.array]  # (queries, q_keys, q_values, scale, mask, group_size, bits) -> out


def attention_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(query heads, kv heads, head_dim) of the model's first full-attention layer; None if it has none."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    for layer in cache:
        if type(layer) is KVCache:
            _, kv_heads, _, head_dim = layer.keys.shape
            args = getattr(model, "args", None)
            heads = int(getattr(args, "num_attention_heads", kv_heads) or kv_heads)
            return heads, kv_heads, head_dim
    return None


def folded_attention(queries: mx.array, q_keys: Any, q_values: Any, scale: float, mask: Any,
                     group_size: int = 64, bits: int = 8) -> mx.array:
    """mlx-lm's quantized SDPA with the GQA repeats folded into the query axis instead of broadcast keys."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    repeats = n_q_heads // n_kv_heads
    q = mx.reshape(queries * scale, (B, n_kv_heads, repeats * L, D))
    scores = mx.quantized_matmul(q, *q_keys, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        kL = scores.shape[-1]
        causal = mx.arange(kL - L, kL)[:, None] >= mx.arange(kL)[None]
        scores = mx.reshape(scores, (B, n_kv_heads, repeats, L, kL))
        scores = mx.where(causal, scores, mx.finfo(scores.dtype).min)
        scores = mx.reshape(scores, (B, n_kv_heads, repeats * L, kL))
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size, bits=bits)
    return mx.reshape(out, (B, n_q_heads, L, D))


def probe(heads: int, kv_heads: int, head_dim: int, *, bits: int, group_size: int, query_len: int,
          whole: bool, attention: Attention = quantized_scaled_dot_product_attention,
          dtype: mx.Dtype = mx.bfloat16, batch: int = 2) -> str | None:
    """One attention over quantized KV, evaluated; None if it runs and is right, else why not.

    `whole`: the keys are a whole buffer (a cache exactly full); else the first positions of a larger one,
    as a cache hands them over between its growth steps. `query_len` 1 is a decode step; more, a prefill
    chunk with a causal mask.
    """
    key_len = 2 * _STEP if whole else 2 * _STEP - 3
    kq, kk, kv = mx.random.split(mx.random.key(0), 3)
    queries = mx.random.normal((batch, heads, query_len, head_dim), key=kq).astype(dtype)
    shape = (batch, kv_heads, 2 * _STEP, head_dim)
    # Small keys keep the softmax flat (bf16's rounding of peaked scores alone moves outputs ~10%). Each
    # (row, kv head)'s values point along their own axis, so attending over another head's or row's values
    # moves the output by ~1.
    own_axis = (mx.arange(batch * kv_heads).reshape(batch, kv_heads, 1, 1) % head_dim == mx.arange(head_dim))
    buffers = [0.25 * mx.random.normal(shape, key=kk), 0.1 * mx.random.normal(shape, key=kv) + own_axis]
    buffers = [x.astype(dtype) for x in buffers]
    q_keys, q_values = (tuple(part[..., :key_len, :] for part in mx.quantize(x, group_size=group_size, bits=bits))
                        for x in buffers)
    mask = "causal" if query_len > 1 else None
    scale = head_dim**-0.5
    try:  # `queries * 1`: mlx-lm scales its argument in place (`queries *= scale`)
        out = attention(queries * 1, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)
        # The reference in float32: the same (dequantized) values, without bf16's rounding of the scores.
        keys, values = (mx.dequantize(*x, group_size=group_size, bits=bits).astype(mx.float32)
                        for x in (q_keys, q_values))
        ref = mx.fast.scaled_dot_product_attention(queries.astype(mx.float32), keys, values, scale=scale, mask=mask)
        err = mx.abs(out.astype(mx.float32) - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-6)
        err_value = err.item()
    except (RuntimeError, ValueError) as exc:
        return str(exc).split("\n")[0]
    if not err_value <= _TOLERANCE:
        return f"wrong values (max error {err_value:.2g} of the largest output; tolerance {_TOLERANCE:g})"
    return None


def serving_failure(shape: tuple[int, int, int], *, bits: int, group_size: int) -> str | None:
    """What breaks mlx-lm's quantized attention for this format and model shape (decode and prefill, both
    buffer layouts a cache produces), or None if it all runs right."""
    heads, kv_heads, head_dim = shape
    if head_dim % group_size:
        return f"group size {group_size} does not divide head_dim {head_dim}"
    for query_len, step in ((1, "decode"), (16, "prefill")):
        for whole in (False, True):
            why = probe(heads, kv_heads, head_dim, bits=bits, group_size=group_size, query_len=query_len,
                        whole=whole)
            if why is not None:
                layout = "a whole buffer" if whole else "a buffer's first positions"
                return f"{step} over {layout}: {why}"
    return None
