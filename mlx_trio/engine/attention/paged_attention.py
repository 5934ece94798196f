"""Attention over a paged cache's block tables: one interface, the kernel chosen by the backend.

`attend(queries, cache, scale, decode)` is what the routed attention calls for a
`PagedLayerCache` (engine/kv/blocks/paged_kv.py), for decode steps and prefill
chunks alike. A decode step (one query a row) goes to `decode` where it is set
and takes the shapes: the CUDA kernel (paged_kernel.py), which reads each
row's blocks in place; `routed_attention.install` sets it only on MLX's CUDA
backend, once its load-time self-check against the reference passed (else it
logs why and leaves it unset), or the Metal kernel (paged_metal.py), only on Metal.

A row alone in its group with several queries (a prefill chunk; a verify step's
row) takes the causal path (`causal_row`): its keys gathered to exactly its
length and MLX's SDPA with `mask="causal"`, which MLX aligns bottom-right when
there are more keys than queries: the call mlx-lm's `KVCache` makes for a lone
row, so on the shape grid the very cuDNN plan a padded chunk uses. (The
reference's boolean mask also reaches cuDNN on CUDA, but as an additive bias
MLX converts per layer, and at the row's table width, a new plan for nearly
every chunk: H100, a long-context mix prefilled at 0.45x the padded layout.) Several
rows of one width group with several queries each (a batch's verify step) keep
the reference: each row its own call would be B launches a layer for a few
queries each. Everything else (the CPU's decode, a failed check) runs the MLX-ops
reference (paged_reference.py), which is exact and runs anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_trio.engine import lease_thread
from mlx_trio.engine.attention import paged_kernel
from mlx_trio.engine.attention.paged_reference import gather_positions, reference_paged_attention

# A decode kernel: (queries, block_keys, block_values, tables, lengths, scale) -> [B, H, 1, D].
PagedDecode = Callable[[mx.array, mx.array, mx.array, mx.array, mx.array, float], mx.array]


# The most transient bytes one reference call may build (gathered K and V and the scores, counted at 4 bytes): a group
# that would build more is attended in pieces of rows, and a long prefill chunk in pieces of queries, so a
# step's transient stays bounded however large the pool and the rows grow.
TRANSIENT_BYTES = 256 << 20


def attend(queries: mx.array, cache: Any, scale: float, decode: PagedDecode | None = None) -> mx.array:
    """The attention of `queries` `[B, H, L, D]` over `cache`'s rows' blocks (its step's tables and lengths).

    Group by group (rows of similar table widths: `PagedStep.groups`), so the reference's gather pads a
    row at most to about twice its own blocks, never to the longest row of the batch. `decode`: the
    kernel for one query a row (L = 1), where the kernel takes the shapes; else the reference.
    """
    step = cache.step
    keys, values = cache.block_keys, cache.block_values
    if decode is not None and queries.shape[2] == 1 and paged_kernel.supports(queries, keys, values):
        outs = [decode(queries if g.index is None else queries[g.index], keys, values, g.tables, g.lengths, scale)
                for g in step.groups]
    else:
        outs = [causal_row(queries if g.index is None else queries[g.index], keys, values, g.key_slots, scale)
                if g.key_slots is not None else
                bounded(queries if g.index is None else queries[g.index], keys, values, g.tables, g.lengths, scale,
                        visible=g.visible) for g in step.groups]
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out if step.restore is None else out[step.restore]


def bounded(queries: mx.array, block_keys: mx.array, block_values: mx.array, tables: mx.array, lengths: mx.array,
            scale: float, limit: int = TRANSIENT_BYTES, visible: mx.array | None = None) -> mx.array:
    """`reference_paged_attention`, in pieces of rows (and of queries) that each build at most about `limit` bytes.

    `visible`: a decode step's mask for all the rows (sliced with them), else built piece by piece."""
    G, H, L, D = queries.shape
    keys_per_row = tables.shape[1] * block_keys.shape[1]
    gathered = 4 * keys_per_row * 2 * block_keys.shape[2] * D  # float32 K and V of one row
    scores = 4 * keys_per_row * H  # one query's scores
    rows = max(1, limit // (gathered + scores * L))
    if rows >= G:
        return reference_paged_attention(queries, block_keys, block_values, tables, lengths, scale, visible)
    if rows > 1 or L == 1:
        return mx.concatenate([
            reference_paged_attention(queries[r : r + rows], block_keys, block_values, tables[r : r + rows],
                                      lengths[r : r + rows], scale, None if visible is None else visible[r : r + rows])
            for r in range(0, G, rows)], axis=0)
    # One row's whole chunk is too much: its queries in pieces, each attending causally up to its own end.
    per = max(1, (limit - gathered) // scores)
    return mx.concatenate([
        mx.concatenate([
            reference_paged_attention(queries[r : r + 1, :, q : q + per], block_keys, block_values,
                                      tables[r : r + 1], lengths[r : r + 1] - (L - min(L, q + per)), scale)
            for q in range(0, L, per)], axis=2)
        for r in range(G)], axis=0)


def scores_materialised() -> bool:
    """Whether MLX's SDPA writes a causal chunk's scores out here: on the CPU (ops), and on CUDA with cuDNN off
    (MLX's fallback: "mlx" attention, engine/lease_thread.py); cuDNN on CUDA and MLX's kernel on Metal fuse it."""
    if lease_thread.on_cuda():
        return os.environ.get(lease_thread.CUDNN_ATTENTION_ENV, "").strip() == "0"
    return mx.default_device() == mx.cpu


def causal_row(queries: mx.array, block_keys: mx.array, block_values: mx.array, key_slots: mx.array, scale: float,
               limit: int | None = None) -> mx.array:
    """The attention of one row's `queries` `[1, H, L, D]`, its last L positions, over its keys at `key_slots`.

    The keys are gathered to exactly their number (`gather_positions`) and attended with `mask="causal"`. Where
    the scores are materialised (`scores_materialised`, or `limit` given) and a call would build more than
    `limit` bytes, in pieces of queries: a piece `[q0, q1)` attends, causally again, to the keys up to its own
    last position, `keys[:K - (L - q1)]`.
    """
    L, K = queries.shape[2], key_slots.shape[0]
    keys = gather_positions(block_keys, key_slots)
    values = gather_positions(block_values, key_slots)
    if limit is None:
        limit = TRANSIENT_BYTES if scores_materialised() else 0
    gathered = 4 * K * 2 * keys.shape[1] * keys.shape[3]
    scores = 4 * K * queries.shape[1]  # one query's
    if not limit or gathered + scores * L <= limit:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal")
    per = max(1, (limit - gathered) // scores)
    pieces = []
    for q0 in range(0, L, per):
        q1 = min(L, q0 + per)
        end = K - (L - q1)
        pieces.append(mx.fast.scaled_dot_product_attention(queries[:, :, q0:q1], keys[:, :, :end], values[:, :, :end],
                                                           scale=scale, mask="causal"))
    return mx.concatenate(pieces, axis=2)
