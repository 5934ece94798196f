"""Attention over block tables in plain MLX ops: the reference, and the path on every backend without a kernel.

Each row gathers its own blocks by its table (`take` over the flat block
view), so its keys are the row's positions `0 .. width * block_size`; a key
counts when it is before the row's length and not after the query's own
position (queries are the row's last `L` positions: L = 1 a decode step,
L > 1 a prefill chunk attending to its cached prefix blocks and to itself
causally). Scores in float32, softmax, values: the same positions mlx-lm's
causal attention reads for a lone row, with no row padded to another's
length in what is held (the gather is this step's transient, `width` blocks
a row; a kernel reads each row's own blocks in place).
"""

from __future__ import annotations

import mlx.core as mx


def gather_rows(blocks: mx.array, tables: mx.array) -> mx.array:
    """Each row's blocks in table order: `[B, kv_heads, width * block_size, head_dim]` from `[N, bs, Hkv, D]`."""
    B, width = tables.shape
    _, bs, kv_heads, D = blocks.shape
    rows = mx.take(blocks, tables.reshape(-1), axis=0)  # [B * width, bs, Hkv, D]
    return rows.reshape(B, width * bs, kv_heads, D).transpose(0, 2, 1, 3)


def reference_paged_attention(queries: mx.array, block_keys: mx.array, block_values: mx.array, tables: mx.array,
                              lengths: mx.array, scale: float) -> mx.array:
    """softmax(scale * q k^T) v of `queries` `[B, H, L, D]` (row b's positions `lengths[b]-L ..`) over its blocks."""
    B, H, L, D = queries.shape
    kv_heads = block_keys.shape[2]
    keys = gather_rows(block_keys, tables).astype(mx.float32)
    values = gather_rows(block_values, tables).astype(mx.float32)
    n_keys = keys.shape[2]
    q = queries.astype(mx.float32).reshape(B, kv_heads, H // kv_heads, L, D) * scale
    scores = q @ keys[:, :, None].swapaxes(-1, -2)  # [B, Hkv, G, L, T]
    lengths = lengths.astype(mx.int32)[:, None, None]  # [B, 1, 1]
    position = lengths - L + mx.arange(L)[None, :, None]  # [B, L, 1]: each query's own position
    visible = mx.arange(n_keys)[None, None, :] <= position  # [B, L, T]; position < length, so length bounds it too
    scores = mx.where(visible[:, None, None], scores, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ values[:, :, None]  # [B, Hkv, G, L, D]
    return out.reshape(B, H, L, D).astype(queries.dtype)
