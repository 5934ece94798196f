"""Per-layer cache surgery for joins and leaves, by cache capability, never by model name.

Every operation here is mlx-lm's own (`merge`, `extend`, `filter`,
`extract` of models/cache.py); this module only picks which one a layer
gets. The running batch's layer is either *solo* (one row's serial-class
cache, adopted zero-copy: `KVCache`, `RotatingKVCache`, `ArraysCache`,
`CacheList`) or *batched* (`BatchKVCache`, as our `HostPaddedBatchKVCache`;
`BatchRotatingKVCache`, a B-row `ArraysCache`, a `CacheList` of those).
Joins, per layer kind:

| running layer            | join                                                          |
| ------------------------ | ------------------------------------------------------------- |
| solo (any kind)          | `merge([running, *new])`: left-pad all into a batch cache      |
| `BatchKVCache`           | `extend(merge(new))`: pad + one B-axis concat, rows untouched   |
| `BatchQuantizedKVCache`  | the same, on the (packed, scales, biases) parts                 |
| `BatchRotatingKVCache`   | re-merge: `extract` every row, then `merge(rows + new)`        |
| `ArraysCache` (SSM)      | `extend(merge(new))`: B-axis concat, no temporal axis           |
| `CacheList`              | the rule above for each child                                  |

Rotating layers re-merge rather than `extend`: `merge` rebuilds every row in
temporal order from its own offset, the layout of a freshly merged batch,
so a join never depends on how far the running ring has rotated; the copy
is bounded by B x window per layer. (mlx-lm's `extend` gives the same tokens;
the two layouts only reorder attention sums, measured <= 1e-5 in float32.)

All functions run on the lease thread and build lazy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import BatchRotatingKVCache, CacheList, KVCache, QuantizedKVCache

from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache
from mlx_trio.engine.kv.quantized_batch_kv import BatchQuantizedKVCache

Cache = Any  # an mlx-lm cache object; they share no base class worth naming


def can_batch(caches: Sequence[Cache]) -> bool:
    """Whether these (fresh, per-layer) caches can join a batch: mlx_lm.server's own rule, plus quantized rows."""
    return all(_mergeable(c) for c in caches)


def _mergeable(cache: Cache) -> bool:
    # mlx-lm's QuantizedKVCache has no `merge`; `merge_rows` batches it as BatchQuantizedKVCache.
    return hasattr(cache, "merge") or type(cache) is QuantizedKVCache


def can_extract(caches: Sequence[Cache]) -> bool:
    """Whether every layer can hand one row back as a serial-class cache."""
    return all(hasattr(c, "extract") for c in caches)


def join_layer(running: Cache, new: Sequence[Cache], *, running_is_solo: bool) -> Cache:
    """The layer cache of the running rows plus the `new` rows last, in order (may mutate `running`).

    `new` are solo caches; they are not mutated, and the result never shares
    buffers with them that a later step could overwrite.
    """
    if not new:
        return running
    if isinstance(running, CacheList):
        return CacheList(*(
            join_layer(r, [n.caches[i] for n in new], running_is_solo=running_is_solo)
            for i, r in enumerate(running.caches)
        ))
    first = new[0]
    if not all(_mergeable(n) for n in new):
        raise TypeError(f"{type(first).__name__} cannot batch (no merge)")
    if running_is_solo:
        return merge_rows([running, *new])
    if isinstance(running, BatchRotatingKVCache):
        rows = [running.extract(i) for i in range(batch_size(running))]
        return BatchRotatingKVCache.merge([*rows, *new])
    if hasattr(running, "extend"):
        running.extend(merge_rows(new))
        return running
    raise TypeError(f"{type(running).__name__} cannot take a joining row (no extend)")


def merge_rows(caches: Sequence[Cache]) -> Cache:
    """Solo caches of one layer as one batched layer (mlx-lm's `merge`).

    Plain `KVCache` layers become `HostPaddedBatchKVCache`: an unpadded batch
    then decodes without a mask (engine/kv/batch_kv.py says why that matters);
    `QuantizedKVCache` layers (one format) become `BatchQuantizedKVCache`.
    """
    if all(type(c) is KVCache for c in caches):
        return HostPaddedBatchKVCache.merge(list(caches))
    if all(type(c) is QuantizedKVCache for c in caches):
        return BatchQuantizedKVCache.merge(list(caches))
    return type(caches[0]).merge(list(caches))


def filter_layer(cache: Cache, keep: list[int]) -> None:
    """Keep only the rows `keep` (in place); full-attention layers also drop padding all survivors share."""
    cache.filter(keep)


def extract_layer(cache: Cache, index: int) -> Cache:
    """Row `index` of a batched layer as a fresh serial-class cache without padding."""
    return cache.extract(index)


def batch_size(cache: Cache) -> int:
    """Rows in a batched layer cache."""
    if isinstance(cache, CacheList):
        return batch_size(cache.caches[0])
    if hasattr(cache, "left_padding") and hasattr(cache, "offset"):
        return int(cache.left_padding.shape[0])
    return int(cache.batch_size)
