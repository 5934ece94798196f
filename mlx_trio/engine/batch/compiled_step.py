"""A decode step's forward as one compiled MLX graph, the KV buffers passed in and returned as arrays.

Today's step builds the model's graph in Python every step: per layer a
dozen ops, each a node the host creates and the device launches alone.
`mx.compile` traces the forward once and replays the traced graph, with
elementwise chains fused into single kernels. It only sees arrays, while
mlx-lm's caches are Python objects that change their own attributes, so the
compiled function is pure: it takes every layer's `(keys, values)` buffers
with the slot this token is written to and the last valid slot, and the
rows' RoPE offsets `[B]` and left padding `[B]`; it returns the logits and
the new buffers. Inside it each layer sees a `_Slot` standing in for its cache:

- `update_and_fetch` writes the token at its slot (`mx.slice_update` with an
  array start, so the position is an input, not a constant of the trace) and
  returns the *whole* buffer, not the `[:idx + 1]` slice mlx-lm returns;
- `make_mask` masks what that adds: `left_padding <= pos <= last`, mlx-lm's
  `BatchKVCache` mask over the whole buffer.

Before the call `_reserve` makes room exactly as mlx-lm's `update_and_fetch`
would have (a buffer grows in 256-token steps; a ring grows, trims an
over-full prefill and wraps), so the caches keep mlx-lm's layout and every
other batch operation works unchanged. A trace then depends only on the
shapes, the rows `B` and each buffer's capacity: a new one retraces once,
about one uncompiled step's graph build (`mx.compile` keeps each trace).
`shapeless=True` would avoid the retraces but traces RoPE's CPU fallback,
whose slices cannot be shapeless.

Numerics: attention runs over the whole buffer with the unused positions
masked, where the uncompiled step runs over exactly `idx + 1` positions
(and, unpadded, without a mask). The masked positions weigh exactly 0, and
on the CPU every step's logits and KV are bit-identical to the uncompiled
step's, float32 and bfloat16 (tests/engine/batch/test_compiled_step.py, with
the tokens of whole schedules and the goldens through the engine). On a GPU
the fused kernels and the other attention kernel may round differently in
the last bits, as padded rows do against solo ones (the device runs:
docs/lab-notes/2026-12-01-compiled-decode.md). On MLX's CUDA backend an
array mask keeps attention off the fused `sdpa_vector` kernel (head dims 64
and 128), so whether this is faster there is what that benchmark measures.

Covered: a lone row on mlx-lm's own caches (`KVCache`, and `RotatingKVCache`
without `keep`, as sliding-window models make them), or a batch on
`HostPaddedBatchKVCache` layers (padded or not), float KV, every layer at
one position. A batch with rotating layers (mlx-lm's `BatchRotatingKVCache`),
SSM state, or quantized KV takes the uncompiled step, and so does, for good,
a model whose trace asks its caches for what a slot does not provide (a
decode mask for a window narrower than its ring: `CompiledForward.broken`).
`--no-compile` turns it all off.

Contract: the model's weights (and any other array the forward reads that
is not a cache's) are constants of a trace, captured by reference. Code
that replaces them (loading or unloading adapters, per-row adapter ids set
on modules) must step uncompiled or start a new `CompiledForward`: passing
`inputs=model.state` to `mx.compile` would track them, but flattening the
weights costs 0.8 ms of host time per step (Llama-1B shape, CPU), a third
more than the call itself.

Runs on the lease thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache
# mlx-lm's KV buffer step (KVCache.step == BatchKVCache.step).
_STEP = 256
# Shapes traced before the traces are dropped (a fresh `mx.compile`; the old one's destructor erases
# its cache) and rebuilt on demand: a server meets many (rows, capacity) pairs over its life.
MAX_TRACES = 64


def compile_wanted(requested: bool | None) -> bool:
    """Whether decode steps compile: as asked (`--no-compile` asks False).

    None (the configuration's default) means on the CPU only, and there for lone rows only
    (`DecodeBatch`): on MLX's CUDA backend the compiled forward's masked attention cannot use the
    fused decode kernel and loses at B=1 and B=64 on an H200, and over a CPU batch it attends the whole
    masked buffer (docs/lab-notes/2026-12-01-compiled-decode.md).
    """
    if requested is None:
        requested = mx.default_device() != mx.gpu
    return requested


class _Slot:
    """What a layer's attention sees as its cache inside the compiled forward (see the module docstring)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, write: mx.array, mask: mx.array,
                 max_size: int | None) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self._write, self._mask, self._max_size = write, mask, max_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self._write, axes=(2,))
        self.values = mx.slice_update(self.values, values, self._write, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        if N != 1 or (window_size is not None and window_size < (self._max_size or 0)):
            # A window narrower than the ring needs mlx-lm's rolled mask: not written here (see `covers`).
            raise _NotCovered(f"a decode mask for N={N}, window {window_size}, ring {self._max_size}")
        return self._mask


class _NotCovered(Exception):
    """Raised while tracing: this model asks its caches for something the slots do not provide."""


def _is_solo_ring(cache: Any) -> bool:
    return type(cache) is RotatingKVCache and cache.keep == 0


def _position(cache: Any) -> int:
    """Tokens the layer's row(s) hold: the RoPE offset of the next token (left padding aside)."""
    return cache._idx if type(cache) is HostPaddedBatchKVCache else cache.offset


def covers(caches: Sequence[Any]) -> bool:
    """Whether the compiled forward can run these layers' step (else the caller runs the model as today).

    Either a lone row (`KVCache` and `RotatingKVCache` layers, as mlx-lm makes them) or a batch
    (`HostPaddedBatchKVCache` layers), float KV already prefilled, every layer at one position.
    """
    batch = all(type(c) is HostPaddedBatchKVCache for c in caches)
    if not caches or not (batch or all(type(c) is KVCache or _is_solo_ring(c) for c in caches)):
        return False
    if any(c.keys is None or not mx.issubdtype(c.keys.dtype, mx.floating) for c in caches):
        return False
    if batch and any(c.keys.shape != caches[0].keys.shape for c in caches):
        return False
    position = _position(caches[0])
    return all(_position(c) == position for c in caches)


def _reserve(cache: Any) -> tuple[int, int]:
    """Make room for this step's token exactly as mlx-lm's `update_and_fetch` would; (write at, last valid).

    The buffers grow (or a ring trims and wraps) before the call, so the caches keep mlx-lm's
    layout and every other batch operation works unchanged.
    """
    if type(cache) is RotatingKVCache:
        return _reserve_ring(cache)
    position = _position(cache)
    if position + 1 > cache.keys.shape[2]:
        keys, values = cache.keys, cache.values
        if position % _STEP:
            keys, values = keys[..., :position, :], values[..., :position, :]
        grow = (*keys.shape[:2], _STEP)
        cache.keys = mx.concatenate([keys, mx.zeros((*grow, keys.shape[3]), keys.dtype)], axis=2)
        cache.values = mx.concatenate([values, mx.zeros((*grow, values.shape[3]), values.dtype)], axis=2)
    return position, position


def _reserve_ring(cache: RotatingKVCache) -> tuple[int, int]:
    """`RotatingKVCache._update_in_place` for one token up to its write: grow, trim, wrap (mlx-lm 0.32)."""
    prev = cache.offset
    if prev >= cache.keys.shape[2] and cache.keys.shape[2] < cache.max_size:
        grow = (*cache.keys.shape[:2], min(cache.step, cache.max_size - prev))
        cache.keys = mx.concatenate([cache.keys, mx.zeros((*grow, cache.keys.shape[3]), cache.keys.dtype)], axis=2)
        cache.values = mx.concatenate([cache.values, mx.zeros((*grow, cache.values.shape[3]), cache.values.dtype)],
                                      axis=2)
        cache._idx = prev
    trim = cache.keys.shape[2] - cache.max_size
    if trim > 0:  # a prefill longer than the window left the ring over-full
        cache.keys, cache.values = cache._trim(trim, cache.keys), cache._trim(trim, cache.values)
        cache._idx = cache.max_size
    if cache._idx == cache.max_size:
        cache._idx = cache.keep
    # After the write mlx-lm attends to the first prev + 1 slots, or to the whole ring once it is full.
    return cache._idx, min(prev, cache.keys.shape[2] - 1)


def _advance(cache: Any) -> None:
    if type(cache) is KVCache:
        cache.offset += 1
    elif type(cache) is RotatingKVCache:
        cache.offset += 1
        cache._idx += 1
    else:
        cache._idx += 1  # HostPadding's offsets follow _idx (engine/kv/batch_kv.py)


class CompiledForward:
    """`model(inputs[:, None], cache=caches)[:, -1, :]` for covered caches, as one compiled graph per shape."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._compiled = mx.compile(self._forward)
        # The shapes traced so far, approximately: (rows, first and last layers' capacities).
        self._traced: set[tuple[int, int, int]] = set()
        # Set when a trace met what the slots do not provide: this model then always steps uncompiled.
        self.broken: str | None = None
        self._max_sizes: list[int | None] = []

    def _forward(self, inputs: mx.array, offsets: mx.array, left_padding: mx.array,
                 layers: list[tuple[mx.array, mx.array, mx.array, mx.array]]
                 ) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
        slots = []
        for (keys, values, write, last), max_size in zip(layers, self._max_sizes):
            positions = mx.arange(keys.shape[2])[None]  # a constant of the trace: one trace per capacity
            valid = (positions <= last) & (positions >= left_padding[:, None])
            # [B, 1, 1, capacity]: mlx-lm's BatchKVCache mask over the whole buffer.
            slots.append(_Slot(keys, values, offsets, write, mx.expand_dims(valid, (1, 2)), max_size))
        logits = self._model(inputs[:, None], cache=slots)[:, -1, :]
        return logits, [(slot.keys, slot.values) for slot in slots]

    def __call__(self, inputs: mx.array, caches: Sequence[Any]) -> mx.array | None:
        """The logits `[B, V]` of one decode step, advancing every cache one token; requires `covers(caches)`.

        None (and `broken` set, caches unchanged but for room made as mlx-lm would) if tracing found
        that this model needs more of its caches than the slots provide: step it uncompiled.
        """
        if self.broken is not None:
            return None
        first = caches[0]
        if type(first) is HostPaddedBatchKVCache:
            offsets, left_padding = first.offset, first.left_padding
        else:
            offsets, left_padding = mx.array([first.offset]), mx.zeros((1,), mx.int32)
        # One scalar array per distinct position, not two per layer: no per-step host work per layer
        # beyond the loop itself (the full-attention layers of a step all share one position).
        scalars: dict[int, mx.array] = {}

        def scalar(value: int) -> mx.array:
            if value not in scalars:
                scalars[value] = mx.array(value)
            return scalars[value]

        layers = []
        for cache in caches:
            write, last = _reserve(cache)
            layers.append((cache.keys, cache.values, scalar(write), scalar(last)))
        shape = (inputs.shape[0], caches[0].keys.shape[2], caches[-1].keys.shape[2])
        if shape not in self._traced:
            if len(self._traced) >= MAX_TRACES:
                self._compiled = mx.compile(self._forward)
                self._traced.clear()
            self._traced.add(shape)
        # Read only while tracing (a guard in _Slot.make_mask); the traced graph does not depend on it.
        self._max_sizes = [c.max_size if type(c) is RotatingKVCache else None for c in caches]
        try:
            logits, buffers = self._compiled(inputs, offsets, left_padding, layers)
        except _NotCovered as exc:
            self.broken = str(exc)
            return None
        for cache, (keys, values) in zip(caches, buffers):
            cache.keys, cache.values = keys, values
            _advance(cache)
        return logits
