"""mlx-lm's `BatchKVCache`, knowing its rows' left padding on the host: no mask for an unpadded step.

`BatchKVCache.make_mask` always returns an array mask, even when no row is
padded and the mask is all true. On MLX's CUDA backend the fused decode
attention kernel (`sdpa_vector`) refuses array masks, so every layer of
every step falls back to unfused attention: scale, matmul, mask, softmax,
matmul, about six kernels in place of one. On an H200 (Llama-1B shape,
B=16, docs/lab-notes/2026-11-29-h200-pass04.md) a step took 5.68 ms with
`BatchKVCache` and 3.65 ms with this class, against 3.59 ms for a plain
`KVCache` of 16 rows.

This subclass keeps a host copy of `left_padding` next to mlx-lm's array,
updated by the same operations (merge, extend, filter) from host numbers
only, never by reading the array back (that would wait for the step in
flight). An L=1 step of a batch in which no row is padded then gets no
mask, as a plain `KVCache` would; with padding, or after any operation
this class does not follow (`prepare`, `finalize`, setting `state`), it is
mlx-lm's mask exactly. The result is the same attention either way: an
all-true mask masks nothing.

It also keeps the rows' offsets (their RoPE positions) once per batch
rather than once per layer. mlx-lm's cache adds 1 to each layer's `[B]`
offset array every step: one kernel per layer, a twentieth of a Llama
layer's launches, for arrays that are equal in every layer. Here a layer's
`offset` is derived from `_idx` (its position count) through a `_Offsets`
object that `share_offsets` hands to every layer of a batch, so the add is
built once per step. The offsets are exactly mlx-lm's (tests/engine/kv/test_batch_kv.py).

All of that is `HostPadding`, a mixin over any cache with mlx-lm's
`BatchKVCache` interface: `HostPaddedBatchKVCache` puts it over bf16
storage, `BatchQuantizedKVCache` (engine/kv/quantized_batch_kv.py) over
quantized storage, so both follow the padding and offsets the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

# Host padding that is not known (the array may have been changed by an operation not mirrored here).
UNKNOWN = None


class _Offsets:
    """Per-row offsets `[B]` as of `idx` cache positions; `at(i)` moves them to `i` (one add, then cached)."""

    __slots__ = ("array", "idx")

    def __init__(self, array: mx.array, idx: int) -> None:
        self.array, self.idx = array, idx

    def at(self, idx: int) -> mx.array:
        if idx != self.idx:
            self.array, self.idx = self.array + (idx - self.idx), idx
        return self.array


def share_offsets(caches: Sequence[Any]) -> None:
    """Let the batch's `HostPadding` layers share one offsets record (one add per step, not per layer).

    Call after every membership change: the layers then hold the same rows
    and positions, so their offsets are equal, and each later step advances
    all of them together.
    """
    layers = [c for c in caches if isinstance(c, HostPadding)]
    if layers:
        shared = _Offsets(layers[0].offset, layers[0]._idx)
        for layer in layers:
            if layer._idx == shared.idx:
                layer._offsets = shared


class HostPadding:
    """Over a `BatchKVCache`-like storage class: `host_padding` mirrors `left_padding`; see the module docstring.

    Put it first in the bases (`class C(HostPadding, Storage)`): its methods
    wrap the storage's through `super()`.
    """

    _idx: int
    _offsets: _Offsets

    def __init__(self, left_padding: list[int], *args: Any, **kwargs: Any) -> None:
        super().__init__(left_padding, *args, **kwargs)  # type: ignore[call-arg]
        self.host_padding: tuple[int, ...] | None = tuple(int(p) for p in left_padding)
        self._host_right: tuple[int, ...] | None = None  # `prepare`'s right padding, until `finalize`

    # -- offsets: derived from _idx, so a step's `_idx += 1` moves them (see the module docstring) --

    @property  # type: ignore[override]
    def offset(self) -> mx.array:
        return self._offsets.at(self._idx)

    @offset.setter
    def offset(self, value: mx.array) -> None:
        # mlx-lm assigns offsets as of the current _idx (its __init__ before setting _idx: 0).
        # Its only in-place update (`offset += n` in `merge`) is on a fresh cache, never a shared record.
        self._offsets = _Offsets(value, getattr(self, "_idx", 0))

    def _anchor(self) -> None:
        """mlx-lm set the offsets and then moved `_idx` to where they belong: re-anchor them there."""
        self._offsets = _Offsets(self._offsets.array, self._idx)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        shared = self._offsets
        out = super().update_and_fetch(keys, values)  # its `offset + n` is built, never evaluated
        self._offsets = shared  # the offsets follow _idx
        return out

    def trim(self, n: int) -> int:
        shared = self._offsets
        n = super().trim(n)
        self._offsets = shared
        return n

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> Any:
        merged = super().merge(caches)  # type: ignore[misc]  # builds cls(padding): the host copy starts right
        if not isinstance(merged, cls):  # mlx-lm returns a plain BatchKVCache when every row is empty
            return cls([0] * len(caches))
        merged._anchor()
        return merged

    def extend(self, other: Any) -> None:
        # mlx-lm pads each side on the left by how far its _idx is behind the longer one.
        theirs = getattr(other, "host_padding", UNKNOWN)
        mine, idx, other_idx = self.host_padding, self._idx, other._idx
        super().extend(other)
        self._anchor()
        if mine is UNKNOWN or theirs is UNKNOWN:
            self.host_padding = UNKNOWN
        else:
            top = max(idx, other_idx)
            self.host_padding = (tuple(p + top - idx for p in mine)
                                 + tuple(p + top - other_idx for p in theirs))

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        mine = self.host_padding
        super().filter(batch_indices)
        self._anchor()
        if mine is UNKNOWN:
            return
        keep = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        kept = [mine[i] for i in keep]
        shared = min(kept) if kept else 0  # mlx-lm drops the padding every survivor has
        self.host_padding = tuple(p - shared for p in kept)

    def prepare(self, *, left_padding: Sequence[int] | None = None, lengths: Sequence[int] | None = None,
                right_padding: Sequence[int] | None = None) -> None:
        """mlx-lm's `prepare`, followed on the host when the padding is given as host numbers (a cohort's)."""
        mine = self.host_padding
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)  # type: ignore[misc]
        hosted = all(p is None or isinstance(p, (list, tuple)) for p in (left_padding, right_padding))
        if mine is UNKNOWN or not hosted:
            self.host_padding = UNKNOWN
            return
        if left_padding is not None:
            mine = tuple(p + int(q) for p, q in zip(mine, left_padding, strict=True))
        if right_padding is not None and max(right_padding, default=0) > 0:
            # `finalize` rolls the right padding to the left: then it is left padding.
            self._host_right = tuple(int(q) for q in right_padding)
        self.host_padding = mine

    def finalize(self) -> None:
        mine, right = self.host_padding, self._host_right
        super().finalize()  # type: ignore[misc]  # its offset update goes through the setter: anchored
        self._host_right = None
        if mine is not UNKNOWN and right is not None:
            self.host_padding = tuple(p + q for p, q in zip(mine, right, strict=True))

    @property
    def state(self) -> Any:
        return super().state  # type: ignore[misc]

    @state.setter
    def state(self, value: Any) -> None:
        super(HostPadding, type(self)).state.fset(self, value)  # type: ignore[misc]
        self._anchor()
        self.host_padding = UNKNOWN

    @property
    def is_unpadded(self) -> bool:
        """No row has left padding (known on the host)."""
        return self.host_padding is not UNKNOWN and not any(self.host_padding)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if N == 1 and kwargs.get("window_size") is None and self.is_unpadded:
            return None  # as KVCache's L=1 mask: lets MLX run its fused decode attention
        return super().make_mask(N, return_array=return_array, **kwargs)  # type: ignore[misc]


class HostPaddedBatchKVCache(HostPadding, BatchKVCache):
    """mlx-lm's `BatchKVCache` (bf16 storage) with host padding and shared offsets; see the module docstring."""

    def extract(self, idx: int) -> KVCache:
        """mlx-lm's `extract`, without reading `left_padding` back when the host knows it.

        mlx-lm evaluates and reads the padding array on every call: a cohort
        handing its rows back (engine/batch/cohort_prefill.py) would wait
        rows x layers times for it.
        """
        padding = self.host_padding
        if padding is UNKNOWN:
            return super().extract(idx)
        cache = KVCache()
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, padding[idx] : self._idx])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, padding[idx] : self._idx])
        cache.offset = cache.keys.shape[2]
        return cache


class CohortKVCache(HostPaddedBatchKVCache):
    """The batch cache of a cohort's shared prefill forwards (engine/batch/cohort_prefill.py), nothing else.

    Only its type differs: under prefill-only cuDNN the routed attention runs these forwards on
    MLX's plain attention ops instead of cuDNN (engine/attention/unfused_attention.py), since each
    cohort's shape would be a new cuDNN plan.
    """
