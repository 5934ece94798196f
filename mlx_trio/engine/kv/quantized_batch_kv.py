"""A batched quantized full-attention cache: mlx-lm's `QuantizedKVCache` storage with `BatchKVCache`'s rows.

mlx-lm has a serial quantized cache (`QuantizedKVCache`: keys and values
each stored as `mx.quantize`'s `(packed, scales, biases)`) and a batched
bf16 one (`BatchKVCache`: rows left-padded to a shared `_idx`, per-row
offsets), but no batched quantized cache. This is the one: the storage
of the first, the row bookkeeping of the second, and our `HostPadding`
over both (engine/kv/batch_kv.py), so padding and offsets follow joins and
leaves exactly as for bf16 rows.

Why a row keeps its tokens: `mx.quantize` groups along the head dimension,
so every (row, head, position) vector is quantized on its own. Left
padding, the batch's other rows and where a row sits on the batch axis
never change a row's quantized values; merge, extend, filter and extract
only move whole positions. A row extracted from here is the
`QuantizedKVCache` it would be alone.

The `bits` and `group_size` attributes are what mlx-lm's attention looks
for (`models/base.py`, `scaled_dot_product_attention`): with them it runs
`quantized_scaled_dot_product_attention`, two `mx.quantized_matmul`s over the
packed values, never a dequantized copy of the cache.

Not supported (never used by the engine: quantized rows neither prefill as a
cohort nor take right padding): `prepare(right_padding=...)` and `finalize`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache

from mlx_trio.engine.kv.batch_kv import HostPadding, HostPaddedBatchKVCache

Quantized = tuple[mx.array, mx.array, mx.array]  # mx.quantize's (packed, scales, biases)


def _positions(x: Quantized, a: int | None, b: int | None) -> Quantized:
    """Positions `a:b` (axis 2) of every part."""
    return tree_map(lambda part: part[..., a:b, :], x)


class _QuantizedBatchStorage(BatchKVCache):
    """`BatchKVCache`'s row logic over `(packed, scales, biases)` triples; `BatchQuantizedKVCache` is the class to use."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        # QuantizedKVCache.update_and_fetch, with the batch's shared `_idx` for its `offset`.
        B, H, n, Dk = keys.shape
        Dv = values.shape[3]
        prev = self._idx
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            per_int = 8 * mx.uint32.size // self.bits
            steps = (self.step + n - 1) // self.step * self.step

            def fresh(dim: int) -> Quantized:
                shape = (B, H, steps)
                return (mx.zeros((*shape, dim // per_int), dtype=mx.uint32),
                        mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                        mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype))

            new_k, new_v = fresh(Dk), fresh(Dv)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                kept_k, kept_v = (_positions(x, None, prev) for x in (self.keys, self.values))
                self.keys, self.values = (tree_map(lambda a, b: mx.concatenate([a, b], axis=2), kept, new)
                                          for kept, new in ((kept_k, new_k), (kept_v, new_v)))
        self.offset = self.offset + n
        self._idx += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = qk[i]
            self.values[i][..., prev : self._idx, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Quantized, Quantized]:
        return _positions(self.keys, None, self._idx), _positions(self.values, None, self._idx)

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        # BatchKVCache.filter, part by part.
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shared = min(self.left_padding.tolist())
        if shared > 0:
            if self.keys is not None:
                self.keys, self.values = (_positions(x, shared, None) for x in (self.keys, self.values))
            self._idx -= shared
            self.left_padding -= shared

    def extend(self, other: _QuantizedBatchStorage) -> None:
        # BatchKVCache.extend, part by part: both sides right-justified at the longer `_idx`.
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        top = max(self._idx, other._idx)
        template = self.keys if self.keys is not None else other.keys
        templates = (template, self.values if self.values is not None else other.values)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def justified(c: _QuantizedBatchStorage) -> tuple[Quantized, Quantized, mx.array, mx.array]:
            left = top - c._idx
            if c.keys is None:
                rows = c.offset.shape[0]
                k, v = (tree_map(lambda t, r=rows: mx.zeros((r, t.shape[1], 0, t.shape[3]), t.dtype), x)
                        for x in templates)
            else:
                k, v = c.keys, c.values
            right = size - k[0].shape[2] - left
            if right < 0:
                k, v = _positions(k, None, right), _positions(v, None, right)
                right = 0
            if left or right:
                pad = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = tree_map(lambda x: mx.pad(x, pad), (k, v))
            return k, v, c.offset, c.left_padding + left

        mine, theirs = justified(self), justified(other)
        self.keys, self.values = (tree_map(lambda a, b: mx.concatenate([a, b]), mine[i], theirs[i]) for i in (0, 1))
        self.offset = mx.concatenate([mine[2], theirs[2]])
        self.left_padding = mx.concatenate([mine[3], theirs[3]])
        self._idx = top

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` without its padding, as the serial `QuantizedKVCache` it would be alone."""
        padding = self.left_padding.tolist()[idx]
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        cache.keys, cache.values = tree_map(lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]),
                                            (self.keys, self.values))
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> _QuantizedBatchStorage:
        """Serial `QuantizedKVCache` rows (one format) left-padded into one batch, as `BatchKVCache.merge` does."""
        formats = {(c.group_size, c.bits) for c in caches}
        if len(formats) != 1:
            raise ValueError(f"rows of different KV formats cannot merge: {sorted(formats)}")
        group_size, bits = formats.pop()
        lengths = [c.offset for c in caches]
        top = max(lengths)
        padding = [top - n for n in lengths]
        merged = cls(padding, group_size=group_size, bits=bits)
        if top == 0:
            return merged
        first = next(c for c in caches if c.keys is not None)

        def empty(template: Quantized) -> Quantized:
            return tree_map(lambda t: mx.zeros((len(caches), t.shape[1], top, t.shape[3]), t.dtype), template)

        keys, values = empty(first.keys), empty(first.values)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for part in range(3):
                keys[part][i : i + 1, :, p:top] = c.keys[part][..., : c.offset, :]
                values[part][i : i + 1, :, p:top] = c.values[part][..., : c.offset, :]
        merged.keys, merged.values = keys, values
        merged.offset += top
        merged._idx = top
        return merged

    def prepare(self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
        if right_padding is not None and max(right_padding) > 0:
            raise NotImplementedError("right padding of a quantized batch")
        super().prepare(left_padding=left_padding, lengths=lengths)

    def finalize(self) -> None:
        pass  # nothing to roll: `prepare` refuses right padding

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits = v
        self._right_padding = None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return int(tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0))


class BatchQuantizedKVCache(HostPadding, _QuantizedBatchStorage):
    """Quantized full-attention rows of a batch, with host padding and shared offsets (see the module docstring)."""

    @classmethod
    def quantizing(cls, cache: HostPaddedBatchKVCache, *, group_size: int, bits: int) -> BatchQuantizedKVCache:
        """`cache`'s rows, padding and offsets with every stored position quantized (lazy), as
        `KVCache.to_quantized` does for one row. `cache` is left as it was."""
        quantized = cls([0], group_size=group_size, bits=bits)
        if cache.keys is not None:
            quantized.keys, quantized.values = (mx.quantize(x, group_size=group_size, bits=bits)
                                                for x in (cache.keys, cache.values))
        quantized.left_padding, quantized._idx = cache.left_padding, cache._idx
        quantized.offset = cache.offset  # anchored at `_idx`, as `cache`'s are
        quantized.host_padding = cache.host_padding
        return quantized
