"""A cohort's rows joining the decode batch as one block: one copy a layer, not one a row (docs/design.md §2.4).

A cohort prefills its rows in one batch cache (engine/batch/cohort_prefill.py)
and hands each row its own caches back: a slice of every layer per row. The
decode batch then joined those rows one by one, and every step of that is an
operation per row per layer: a slot's `slice_update`, or mlx-lm's `merge`
(H200, 1B shape: 27 rows into the batch took 58 ms, where the device has
microseconds of copying to do; docs/lab-notes/2026-12-04-h200-pass18.md). Here the
rows that join together from one cohort are copied out of the cohort's cache
in one gather a layer (`take_rows`), or written into the batch's free slots
in one scatter a layer (`write_block`), right-aligned as row_slots.py writes
a single row. The rows' own caches are never evaluated then (they are lazy
slices of the cohort's cache, dropped at the join).

Numerics: each row's real positions hold exactly its cohort row's KV, as
with a row-by-row join; what differs is only what the masked padding before
them holds (another row's padding or junk, finite), which no attention reads.
Functions run on the lease thread and build lazy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx

from mlx_trio.engine.kv import batch_kv
from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache
from mlx_trio.engine.kv.row_slots import relayout, set_padding


@attrs.frozen(eq=False)
class RowBlock:
    """Where a cohort row's KV sits in its cohort's cache: the cache's layers (shared by the cohort's rows) and
    the row's batch index in them. Valid while the row's caches are the slices its cohort handed back."""

    layers: Sequence[HostPaddedBatchKVCache]
    index: int


def shared_block(blocks: Sequence[RowBlock | None]) -> tuple[Sequence[HostPaddedBatchKVCache], list[int]] | None:
    """The cohort cache every joiner's block is in, and their indices in it (joiners' order); None when the joiners
    are not all rows of one cohort whose padding is known on the host."""
    if not blocks or any(block is None for block in blocks):
        return None
    layers = blocks[0].layers  # type: ignore[union-attr]
    if any(block.layers is not layers for block in blocks):  # type: ignore[union-attr]
        return None
    if not all(isinstance(layer, HostPaddedBatchKVCache) and layer.keys is not None
               and layer.host_padding is not batch_kv.UNKNOWN for layer in layers):
        return None
    return layers, [block.index for block in blocks]  # type: ignore[union-attr]


def batch_index(index: Sequence[int]) -> Any:
    """A batch-axis index for `index`: a slice when it is a contiguous run (a view), else an array (a gather)."""
    index = list(index)
    contiguous = index == list(range(index[0], index[0] + len(index)))
    return slice(index[0], index[0] + len(index)) if contiguous else mx.array(index)


def take_rows(layer: HostPaddedBatchKVCache, index: list[int]) -> HostPaddedBatchKVCache:
    """Rows `index` of a cohort's layer as a batch layer of their own (the padding they all share cut off)."""
    padding = [layer.host_padding[i] for i in index]  # type: ignore[index]
    shared = min(padding)
    rows = batch_index(index)
    out = HostPaddedBatchKVCache([p - shared for p in padding])
    out.keys = layer.keys[rows, :, shared : layer._idx, :]
    out.values = layer.values[rows, :, shared : layer._idx, :]
    out._idx = layer._idx - shared
    set_padding(out, [p - shared for p in padding])
    return out


def write_block(caches: Sequence[HostPaddedBatchKVCache], slots: Sequence[int], layers: Sequence[HostPaddedBatchKVCache],
                index: list[int], num_slots: int) -> bool:
    """Write rows `index` of a cohort's `layers` into slots `slots` of the batch's `caches` (one scatter a layer),
    with `num_slots` slots; as row_slots.py `write_rows` writes solo rows. Returns whether a re-layout happened."""
    relaid = False
    where = batch_index(slots)
    rows = batch_index(index)
    for cache, layer in zip(caches, layers, strict=True):
        lengths = [layer._idx - layer.host_padding[i] for i in index]  # type: ignore[index]
        longest = max(lengths)
        shift = max(0, longest - cache._idx)
        if shift or num_slots != len(cache.host_padding):  # type: ignore[arg-type]
            relayout(cache, num_slots, shift)
            relaid = True
        idx = cache._idx
        cache.keys[where, :, idx - longest : idx, :] = layer.keys[rows, :, layer._idx - longest : layer._idx, :]
        cache.values[where, :, idx - longest : idx, :] = layer.values[rows, :, layer._idx - longest : layer._idx, :]
        padding = list(cache.host_padding)  # type: ignore[arg-type]
        for slot, n in zip(slots, lengths, strict=True):
            padding[slot] = idx - n
        set_padding(cache, padding)
    batch_kv.share_offsets(caches)
    return relaid
