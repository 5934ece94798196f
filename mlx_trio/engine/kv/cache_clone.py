"""Copies of per-layer caches that later writes on either side cannot change. Lease thread only.

mlx-lm's serial caches update in place: `keys[..., a:b, :] = k` rebinds the
*same* Python array object, and a cache's `state` hands out those very
objects. Two caches holding one array object would therefore see each
other's writes. A clone gives every array a new object over the same
buffer: MLX then copies on the first write (the buffer is shared, so it is
not donated), so a clone costs nothing until it is written, and the entry it
came from never changes. That is what makes prompt-cache hits
non-consuming (engine/prompt_cache/ram_tier.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry

Cache = Any


def clone(caches: Sequence[Cache]) -> list[Cache]:
    """Fresh cache objects with the same contents (lazy: shares buffers until written)."""
    return [_clone_layer(c) for c in caches]


def _clone_layer(cache: Cache) -> Cache:
    state = tree_map(lambda x: x[...] if isinstance(x, mx.array) else x, cache.state,
                     is_leaf=lambda x: isinstance(x, mx.array) or x is None)
    return type(cache).from_state(state)


def trimmable(caches: Sequence[Cache]) -> bool:
    return all(c.is_trimmable() for c in caches)


def nbytes(caches: Sequence[Cache]) -> int:
    return sum(c.nbytes for c in caches)


def take(caches: Sequence[Cache], trim: int) -> list[Cache]:
    """A clone of `caches` without their last `trim` tokens (which must be trimmable when `trim > 0`)."""
    copies = clone(caches)
    if trim:
        for cache in copies:
            if cache.trim(trim) != trim:
                raise ValueError(f"cannot trim {trim} tokens from a {type(cache).__name__}")
    return copies


def entry(tokens: Sequence[int], caches: list[Cache]) -> CacheEntry:
    """`caches` (holding exactly `tokens`), evaluated, as a prompt-cache entry. Takes them over."""
    mx.eval([c.state for c in caches])
    return CacheEntry(tuple(tokens), caches, nbytes(caches), trimmable(caches),
                      quantized=any(hasattr(c, "bits") for c in caches))


def snapshot(tokens: Sequence[int], caches: Sequence[Cache]) -> CacheEntry:
    """An entry of a clone of `caches`: what later prefill chunks write into them never reaches it."""
    return entry(tokens, clone(caches))
