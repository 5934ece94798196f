"""One forward's arrays over rows' block tables, built once for every layer (`PagedKV.step`).

The rows are attended in groups of similar table width (`width_groups`), each
gathered to its own widest row, so one long row beside many short ones is never
padded to the long one (engine/attention/paged_attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx
import numpy as np

from mlx_trio.engine.kv.blocks.row import PagedRow

# A step's rows are attended in groups of similar table widths, each gathered to its own widest row: one
# group's widest table is at most this many times its narrowest, so the gather's transient is at most about
# this many times the KV the rows hold (one long row beside many short ones is never padded to the long one).
GROUP_WIDTH_RATIO = 2


@attrs.frozen(eq=False)
class StepGroup:
    """Rows of a step whose tables are of similar width, attended together."""

    index: mx.array | None  # the rows' places in the step's batch (None: all rows, in order)
    tables: mx.array  # [G, widest] int32; past a row's own blocks, its first block (never read: masked by length)
    lengths: mx.array  # [G] int32: each row's KV length once this step's tokens are written (with any dummies)
    # A decode step's mask [G, 1, 1, widest * block_size], built once for every layer (`visible_mask`); None for
    # a prefill chunk (its [L, keys] mask is built piece by piece, within the attention's transient bound).
    visible: mx.array | None = None
    # Each row's key length once this step's tokens are written, on the host: read at attention time, when a lone
    # row's `PagedRowCache` may have advanced `row.length` already (its last layer commits before it attends).
    key_lengths: tuple[int, ...] = ()
    # A lone row's chunk (one row, L > 1): the flat-view slot of each of its `key_lengths[0]` keys, in order, so
    # the causal path gathers exactly its keys (engine/attention/paged_attention.py); None otherwise.
    key_slots: mx.array | None = None


@attrs.frozen(eq=False)
class PagedStep:
    """One forward's arrays, built once for every layer: see `PagedKV.step`."""

    rows: tuple[PagedRow, ...]
    queries: int  # new positions per row (L)
    groups: tuple[StepGroup, ...]
    restore: mx.array | None  # the batch order of the groups' rows concatenated (None: already in order)
    slots: mx.array  # [B * L] int32: where each new token's K/V goes in the flat block view
    offset: int | mx.array  # RoPE offset: an int for one row (as mlx-lm's KVCache), else per row [B]
    # A lone row's positions before its length fed again as queries (`RowForward.lead`): attended, not written.
    lead: int = 0


def width_groups(widths: Sequence[int], ratio: int = GROUP_WIDTH_RATIO) -> list[list[int]]:
    """Row indices grouped by table width, narrowest first: in each group the widest is at most `ratio` x the
    narrowest (equal widths: one group)."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and widths[i] <= ratio * max(1, widths[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def visible_mask(lengths: mx.array, queries: int, keys: int) -> mx.array:
    """`[G, 1, L, keys]`: key `j` is visible to query `i` of row `g` when `j` is not after the query's position
    (`lengths[g] - L + i`; so never at or past the row's length either)."""
    position = lengths.astype(mx.int32)[:, None, None] - queries + mx.arange(queries)[None, :, None]
    return (mx.arange(keys)[None, None, :] <= position)[:, None]


def build_groups(rows: Sequence[PagedRow], L: int, block_size: int,
                 dummies: int = 0) -> tuple[tuple[StepGroup, ...], mx.array | None]:
    """The step's width groups (`width_groups`) with their tables and lengths, and the order that restores the
    batch's (None: the groups are the batch in order).

    `dummies`: a lone row's padding queries after its `L` real ones (the prefill shape grid,
    engine/batch/chunked_prefill.py): never written, allocated or committed. Their keys are the row's first
    key again: causal attention keeps them out of every real query's result, but a masked key still meets
    a zero weight in the product with the values, and a slot never written could hold anything (0 x NaN)."""
    out = []
    attended = L + dummies
    grouped = width_groups([len(row.blocks) for row in rows])
    for members in grouped:
        key_lengths = tuple(rows[i].length + attended for i in members)
        width = max(max(len(rows[i].blocks) for i in members), -(-max(key_lengths) // block_size))
        tables = np.empty((len(members), width), np.int32)
        for k, i in enumerate(members):
            own = rows[i].table()
            tables[k, : len(own)] = own
            tables[k, len(own) :] = own[0]  # past its own blocks: any block of its own (masked by length)
        index = None if len(grouped) == 1 and members == sorted(members) else mx.array(members, dtype=mx.int32)
        lengths = mx.array(key_lengths, dtype=mx.int32)
        visible = visible_mask(lengths, 1, width * block_size) if attended == 1 else None
        key_slots = None
        if len(members) == 1 and attended > 1:
            positions = np.arange(key_lengths[0])
            positions[key_lengths[0] - dummies :] = 0  # a dummy's key: the row's first, written (finite) KV
            key_slots = mx.array((tables[0, positions // block_size] * block_size + positions % block_size)
                                 .astype(np.int32))
        out.append(StepGroup(index, mx.array(tables), lengths, visible, key_lengths, key_slots))
    order = [i for members in grouped for i in members]
    restore = None
    if order != list(range(len(rows))):
        back = [0] * len(order)
        for position, i in enumerate(order):
            back[i] = position
        restore = mx.array(back, dtype=mx.int32)
    return tuple(out), restore
