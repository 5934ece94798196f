"""Drop a different number of newest tokens from each row of a decode batch's KV (speculative rollback).

A verification forward writes `1 + Kmax` positions for every row; row `b`
keeps `1 + a_b` of them and must lose its rejected tail of `r_b` positions.
mlx-lm's `BatchKVCache` has one write index (`_idx`) for all rows, so it
cannot trim rows by different amounts. The rule used here:

1. `trim(min(r))` for every row: the tail every row rejects goes, as a
   plain trim (B=1 solo caches need nothing else, which keeps a lone row on
   the serial graph).
2. Each row with more to drop (`s_b = r_b - min(r) > 0`) is rotated right
   by `s_b` along the sequence axis over its first `_idx` positions, and its
   left padding grows by `s_b`. Its kept tokens then end at `_idx` like every
   other row's; the rejected ones land in the (masked) left padding. This is
   mlx-lm's own `prepare(right_padding=...)` + `finalize()` mechanism
   (`dynamic_roll`), restricted to the live positions and with the host
   padding mirror and the shared offsets kept exact.

Each row's RoPE offset (`_idx - left_padding`) is then exactly the number of
tokens it holds, and the mask hides its padding, so the next step sees each
row's KV as if it had been fed only its accepted tokens. The cost is one
gather of the live KV per layer in a step where rows accepted different
amounts; rows that accept more grow the batch's padding for the others,
which `filter` drops again when the row leaves (engine/kv/batch_kv.py).

Full-attention layers are supported (`supports_rollback`): `KVCache` and
`QuantizedKVCache` (solo), `HostPaddedBatchKVCache` and
`BatchQuantizedKVCache` (batched). Quantized KV rolls back exactly:
`mx.quantize` groups along the head dimension, so each stored position is
quantized on its own and a trim or a rotation of whole positions (each of
packed values, scales and biases alike) leaves every kept position's
values as they were (engine/kv/quantized_batch_kv.py). Sliding-window and
recurrent layers cannot drop a tail this way, and such models do not
speculate. Runs on the lease thread; builds lazy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, dynamic_roll

from mlx_trio.engine.kv import batch_kv
from mlx_trio.engine.kv.batch_kv import HostPadding, HostPaddedBatchKVCache
from mlx_trio.engine.kv.quantized_batch_kv import BatchQuantizedKVCache

_ROLLBACK_TYPES = (KVCache, QuantizedKVCache, HostPaddedBatchKVCache, BatchQuantizedKVCache)


def supports_rollback(caches: Sequence[Any]) -> bool:
    """Whether every layer is a full-attention cache whose rows this module can roll back."""
    return bool(caches) and all(type(c) in _ROLLBACK_TYPES for c in caches)


def roll_back_rows(caches: Sequence[Any], rejected: Sequence[int]) -> None:
    """Drop the newest `rejected[b]` positions of row `b` from every layer (in place).

    Solo caches (one row) are trimmed; batched layers are trimmed by the
    common part and rotated for the rest (see the module docstring).
    """
    common = min(rejected)
    extra = [r - common for r in rejected]
    for cache in caches:
        if common:
            cache.trim(common)
    if not any(extra):
        return
    batched = [c for c in caches if isinstance(c, HostPadding)]
    if len(batched) != len(caches):
        raise TypeError("per-row rollback needs batched (HostPadding) layers")
    shifts = mx.array(extra, dtype=mx.int32)
    for cache in batched:
        idx = cache._idx
        for name in ("keys", "values"):
            buffer = getattr(cache, name)
            if isinstance(buffer, (list, tuple)):  # quantized: (packed, scales, biases), each rolled alike
                setattr(cache, name, type(buffer)(_rolled(part, idx, shifts) for part in buffer))
            else:
                setattr(cache, name, _rolled(buffer, idx, shifts))
        cache.left_padding = cache.left_padding + shifts
        cache.offset = cache.offset - shifts  # a fresh offsets record; shared again below
        if cache.host_padding is not batch_kv.UNKNOWN:
            cache.host_padding = tuple(p + s for p, s in zip(cache.host_padding, extra))
    batch_kv.share_offsets(caches)


def _rolled(buffer: mx.array, idx: int, shifts: mx.array) -> mx.array:
    """`buffer` with each row's first `idx` positions rotated right by its shift (in place where it is longer)."""
    rolled = dynamic_roll(buffer[..., :idx, :], shifts[:, None], axis=2)
    if idx == buffer.shape[2]:
        return rolled
    buffer[..., :idx, :] = rolled
    return buffer
