"""A decode step's forward as one compiled MLX graph, the KV buffers passed in and returned as arrays.

Today's step builds the model's graph in Python every step: per layer a
dozen ops, each a node the host creates and the device launches alone.
`mx.compile` traces the forward once and replays the traced graph, with
elementwise chains fused into single kernels. It only sees arrays, while
mlx-lm's caches are Python objects that change their own attributes, so the
compiled function is pure: it takes every layer's `(keys, values)` buffers,
the write position `idx`, the rows' RoPE offsets `[B]` and left padding
`[B]`, and returns the logits and the new buffers. Inside it each layer sees
a `_Slot` standing in for its cache:

- `update_and_fetch` writes the token at `idx` (`mx.slice_update` with an
  array start, so the position is an input, not a constant of the trace) and
  returns the *whole* buffer, not the `[:idx + 1]` slice mlx-lm returns;
- `make_mask` masks what that adds: the positions past `idx` (and each
  row's left padding), `left_padding <= pos <= idx`, mlx-lm's
  `BatchKVCache` mask over the whole buffer.

So a trace depends only on the shapes: the rows `B` and the buffer capacity,
which grows in mlx-lm's 256-token steps (`_reserve` grows it before the call
exactly as `update_and_fetch` would have, so the caches' layout stays
mlx-lm's and every other batch operation works unchanged). A new `(B,
capacity)` retraces once, about one uncompiled step's graph build
(`mx.compile` keeps each trace); `shapeless=True` would avoid that but
traces RoPE's CPU fallback, whose slices cannot be shapeless.

Numerics: attention runs over the whole buffer with the unused positions
masked, where the uncompiled step runs over exactly `idx + 1` positions
(and, unpadded, without a mask). The masked positions weigh exactly 0, and
on the CPU every step's logits and KV are bit-identical to the uncompiled
step's, float32 and bfloat16 (tests/engine/batch/test_compiled_step.py, with
the tokens of whole schedules and the goldens through the engine). On a GPU
the fused kernels and the other attention kernel may round differently in
the last bits, as padded rows do against solo ones; benchmarks/compiled_decode.py
reports whether the greedy tokens still agree there. On MLX's CUDA backend an
array mask keeps attention off the fused `sdpa_vector` kernel (head dims 64
and 128), so whether this is faster there is what that benchmark measures.

Covered: every layer a bf16/float `KVCache` (a lone row) or a
`HostPaddedBatchKVCache` (a batch, padded or not), all at one position and
capacity. Anything else (rotating windows, SSM state, quantized KV) takes
the uncompiled step. `--no-compile` or `MLX_TRIO_NO_COMPILE=1` turns it off.

Runs on the lease thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache

# Set to 1 to restore the uncompiled step whatever the configuration says (the kill switch).
KILL_SWITCH = "MLX_TRIO_NO_COMPILE"
# mlx-lm's KV buffer step (KVCache.step == BatchKVCache.step).
_STEP = 256


def compile_wanted(requested: bool) -> bool:
    """Whether decode steps compile: asked for (no `--no-compile`) and not killed by `MLX_TRIO_NO_COMPILE=1`."""
    return requested and os.environ.get(KILL_SWITCH, "") not in ("1", "true", "yes")


class _Slot:
    """What a layer's attention sees as its cache inside the compiled forward (see the module docstring)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, idx: mx.array, mask: mx.array) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self._idx, self._mask = idx, mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self._idx, axes=(2,))
        self.values = mx.slice_update(self.values, values, self._idx, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        assert N == 1 and window_size is None  # covers() admits decode steps of full-attention layers only
        return self._mask


def _position(cache: Any) -> int:
    return cache.offset if type(cache) is KVCache else cache._idx


def covers(caches: Sequence[Any]) -> bool:
    """Whether the compiled forward can run these layers' step (else the caller runs the model as today)."""
    if not caches:
        return False
    kind = type(caches[0])
    if kind not in (KVCache, HostPaddedBatchKVCache) or any(type(c) is not kind for c in caches):
        return False
    first = caches[0]
    if first.keys is None or not mx.issubdtype(first.keys.dtype, mx.floating):
        return False
    position, shape = _position(first), first.keys.shape
    return all(c.keys is not None and _position(c) == position and c.keys.shape == shape for c in caches)


def _reserve(caches: Sequence[Any]) -> None:
    """Grow every full buffer by one 256-token step, exactly as mlx-lm's `update_and_fetch` would for this token."""
    position = _position(caches[0])
    if position + 1 <= caches[0].keys.shape[2]:
        return
    for cache in caches:
        keys, values = cache.keys, cache.values
        if position % _STEP:
            keys, values = keys[..., :position, :], values[..., :position, :]
        grow = (*keys.shape[:2], _STEP)
        cache.keys = mx.concatenate([keys, mx.zeros((*grow, keys.shape[3]), keys.dtype)], axis=2)
        cache.values = mx.concatenate([values, mx.zeros((*grow, values.shape[3]), values.dtype)], axis=2)


class CompiledForward:
    """`model(inputs[:, None], cache=caches)[:, -1, :]` for covered caches, as one compiled graph per shape."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._compiled = mx.compile(self._forward)
        self._positions = mx.arange(0)

    def _forward(self, inputs: mx.array, offsets: mx.array, idx: mx.array, left_padding: mx.array,
                 positions: mx.array, buffers: list[tuple[mx.array, mx.array]]
                 ) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
        valid = (positions[None] <= idx) & (positions[None] >= left_padding[:, None])
        mask = mx.expand_dims(valid, (1, 2))  # [B, 1, 1, capacity], as mlx-lm's BatchKVCache mask
        slots = [_Slot(keys, values, offsets, idx, mask) for keys, values in buffers]
        logits = self._model(inputs[:, None], cache=slots)[:, -1, :]
        return logits, [(slot.keys, slot.values) for slot in slots]

    def __call__(self, inputs: mx.array, caches: Sequence[Any]) -> mx.array:
        """The logits `[B, V]` of one decode step; advances every cache by one token. Requires `covers(caches)`."""
        _reserve(caches)
        first = caches[0]
        capacity = first.keys.shape[2]
        if self._positions.size != capacity:
            self._positions = mx.arange(capacity)
        if type(first) is KVCache:
            idx = first.offset
            offsets, left_padding = mx.array([idx]), mx.zeros((1,), mx.int32)
        else:
            idx = first._idx
            offsets, left_padding = first.offset, first.left_padding
        logits, buffers = self._compiled(inputs, offsets, mx.array(idx), left_padding, self._positions,
                                         [(c.keys, c.values) for c in caches])
        for cache, (keys, values) in zip(caches, buffers):
            cache.keys, cache.values = keys, values
            if type(cache) is KVCache:
                cache.offset += 1
            else:
                cache._idx += 1  # HostPadding's offsets follow _idx (engine/kv/batch_kv.py)
        return logits
