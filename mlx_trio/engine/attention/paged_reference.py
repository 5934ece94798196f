"""Attention over block tables in plain MLX ops: the reference, and the path on every backend without a kernel.

Each row gathers its own blocks by its table (`take` over the flat block
view), so its keys are the row's positions `0 .. width * block_size`; a key
counts when it is before the row's length and not after the query's own
position (queries are the row's last `L` positions: L = 1 a decode step,
L > 1 a prefill chunk attending to its cached prefix blocks and to itself
causally). The attention itself is MLX's `scaled_dot_product_attention` over
the gathered keys with that boolean mask: the same positions, and the same
function, as mlx-lm's attention for a lone row (a hand-written float32
softmax measured no closer and slower on the CPU). No row is padded to
another's length in what is held (the gather is this step's transient,
`width` blocks a row; a kernel reads each row's own blocks in place).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_trio.engine.kv.blocks.step import visible_mask


def gather_rows(blocks: mx.array, tables: mx.array) -> mx.array:
    """Each row's blocks in table order: `[B, kv_heads, width * block_size, head_dim]` from `[N, bs, Hkv, D]`."""
    B, width = tables.shape
    _, bs, kv_heads, D = blocks.shape
    rows = mx.take(blocks, tables.reshape(-1), axis=0)  # [B * width, bs, Hkv, D]
    return rows.reshape(B, width * bs, kv_heads, D).transpose(0, 2, 1, 3)


def gather_positions(blocks: mx.array, slots: mx.array) -> mx.array:
    """One row's keys (or values) at `slots` of the flat block view, in order: `[1, kv_heads, len(slots), head_dim]`.

    One gather from the pool seen as `[kv_heads, num_blocks * block_size, head_dim]` (a transposed view, no
    copy), so the result is contiguous in the layout of mlx-lm's `KVCache` buffer: the strides cuDNN plans by,
    as a padded prefill's chunk on the grid has them (engine/batch/prefill_plans.py)."""
    N, bs, kv_heads, D = blocks.shape
    flat = blocks.reshape(N * bs, kv_heads, D).transpose(1, 0, 2)
    return mx.take(flat, slots, axis=1)[None]


def reference_paged_attention(queries: mx.array, block_keys: mx.array, block_values: mx.array, tables: mx.array,
                              lengths: mx.array, scale: float, visible: mx.array | None = None) -> mx.array:
    """softmax(scale * q k^T) v of `queries` `[B, H, L, D]` (row b's positions `lengths[b]-L ..`) over its blocks.

    `visible`: the step's mask (`visible_mask`), when it built one for every layer."""
    keys = gather_rows(block_keys, tables)
    values = gather_rows(block_values, tables)
    if visible is None:
        visible = visible_mask(lengths, queries.shape[2], keys.shape[2])
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=visible)
