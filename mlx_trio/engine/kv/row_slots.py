"""Row slots in a batch's KV: a leaving row frees its slot without copying the others; a joiner is written into one.

mlx-lm's `filter` (a leave) gathers every surviving row's KV into new
buffers, and its `extend` (a join) pads and concatenates the whole batch
again: under a serving load, where a row joins or leaves every couple of
steps, each membership change copies all the batch's KV. Here the batch
axis of a `HostPaddedBatchKVCache` layer is a set of *slots*:

- a leaving row's slot stays where it is and goes on decoding junk (its
  outputs are dropped by the caller, engine/batch/decode_batch.py); no other
  row moves;
- a joining row of length `L <= idx` (the batch's position count) is written
  into a free slot, right-aligned at `[idx - L, idx)`, with left padding
  `idx - L`: one in-place `slice_update` of that row only. What the slot held
  before sits in the padded, masked positions;
- only a joiner longer than `idx`, or more joiners than free slots, forces a
  re-layout: one copy of every row into fresh buffers (the rows shifted right
  by the excess, the slots grown by an eighth, KV capacity rounded up to mlx-lm's
  256-token step so the next steps do not grow it again);
- a front that every live row has as padding is cut off (the same re-layout,
  shifted left) once it is a quarter of `idx`, so attention does not read a
  growing masked prefix for ever.

Numerics: every live row sees exactly its own tokens at its own RoPE
positions; positions before its padding are masked, as in mlx-lm's own
padded batches, and weigh exactly 0 (so does a dead slot's junk, which no
live row's attention reads: rows never mix). A slot's junk is finite (a real
forward's KV, or zeros), so a masked position cannot turn into NaN.

The layout needs each layer's padding on the host (`HostPadding`) and plain
bf16/float `HostPaddedBatchKVCache` layers; the caller keeps mlx-lm's
`filter`/`extend` for everything else (quantized KV, rotating layers, SSM
state). Functions run on the lease thread and build lazy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_trio.engine.kv import batch_kv
from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache
# Cut the front every live row has as padding once it reaches this share of the batch's positions.
TRIM_SHARE = 0.25


def supports_slots(caches: Sequence[Any]) -> bool:
    """Whether every layer is a filled `HostPaddedBatchKVCache` whose padding is known on the host."""
    return bool(caches) and all(
        type(c) is HostPaddedBatchKVCache and c.keys is not None and c.host_padding is not batch_kv.UNKNOWN
        for c in caches)


def can_fill(rows: Sequence[Sequence[Any]]) -> bool:
    """Whether these joiners' solo caches can be written into slots (plain, filled `KVCache` layers)."""
    return all(type(c) is KVCache and c.keys is not None for caches in rows for c in caches)


def write_rows(caches: Sequence[HostPaddedBatchKVCache], slots: Sequence[int], rows: Sequence[Sequence[KVCache]],
               num_slots: int) -> bool:
    """Write each joiner's layers (`rows[j]`, solo) into slot `slots[j]` of every layer, with `num_slots` slots.

    A re-layout (one copy of every row) happens only when `num_slots` grows
    or a joiner is longer than the batch (see the module docstring); returns whether one did.
    """
    relaid = False
    for i, cache in enumerate(caches):
        layer_rows = [row[i] for row in rows]
        shift = max(0, max(r.offset for r in layer_rows) - cache._idx)
        if shift or num_slots != len(cache.host_padding):
            relayout(cache, num_slots, shift)
            relaid = True
        idx = cache._idx
        padding = list(cache.host_padding)
        for slot, row in zip(slots, layer_rows):
            n = row.offset
            cache.keys[slot:slot + 1, :, idx - n:idx, :] = row.keys[..., :n, :]
            cache.values[slot:slot + 1, :, idx - n:idx, :] = row.values[..., :n, :]
            padding[slot] = idx - n
        set_padding(cache, padding)
    batch_kv.share_offsets(caches)
    return relaid


def trim_front(caches: Sequence[HostPaddedBatchKVCache], live: Sequence[int]) -> bool:
    """Cut the padding every `live` slot shares, once it is `TRIM_SHARE` of the positions; whether it did."""
    first = caches[0]
    shared = min(first.host_padding[s] for s in live)
    if shared <= 0 or shared < TRIM_SHARE * first._idx:
        return False
    for cache in caches:
        relayout(cache, len(cache.host_padding), -shared)
    batch_kv.share_offsets(caches)
    return True


def relayout(cache: HostPaddedBatchKVCache, num_slots: int, shift: int) -> None:
    """Copy every row into fresh buffers of `num_slots` rows, moved right by `shift` positions (left if < 0).

    New slots hold zeros with no padding; a row whose padding a left shift
    would make negative is a dead slot's (the caller cuts only what every live
    row has as padding): its junk is cut, its padding becomes 0.
    """
    idx, rows = cache._idx, min(num_slots, len(cache.host_padding))
    new_idx = idx + shift
    capacity = -(-(new_idx + 1) // cache.step) * cache.step  # mlx-lm's buffer step, as its growth would round
    keep_from = max(0, -shift)
    for name in ("keys", "values"):
        old = getattr(cache, name)
        fresh = mx.zeros((num_slots, old.shape[1], capacity, old.shape[3]), old.dtype)
        fresh[:rows, :, max(0, shift):new_idx, :] = old[:rows, :, keep_from:idx, :]
        setattr(cache, name, fresh)
    padding = [max(0, p + shift) for p in cache.host_padding[:rows]] + [0] * (num_slots - rows)
    cache._idx = new_idx
    set_padding(cache, padding)


def set_padding(cache: HostPaddedBatchKVCache, padding: list[int]) -> None:
    """Set the rows' padding and offsets from host numbers (offset = idx - padding, as mlx-lm keeps them)."""
    cache.host_padding = tuple(padding)
    cache.left_padding = mx.array(padding, dtype=mx.int32)
    cache.offset = mx.array([cache._idx - p for p in padding], dtype=mx.int32)  # anchored at the current _idx
