"""Decode's KV buffers laid out so that MLX's CUDA backend runs its vector kernel, not cuDNN.

Prefill-only cuDNN attention (`MLX_TRIO_ATTENTION_BACKEND=cudnn-prefill`,
engine/lease_thread.py) turns cuDNN on for the whole process, because MLX
reads `MLX_CUDA_USE_CUDNN_SDPA` once. What keeps decode steps on MLX's
`sdpa_vector` kernel is a per-call condition of MLX's dispatch (mlx
0.32, `backend/cuda/scaled_dot_product_attention.cpp`, docs/design.md
§4.6): a query of length 1 goes to cuDNN only when its keys and values are
a slice of a buffer whose allocated length is a multiple of 256 (mlx-lm's
growth step: MLX recognises mlx-lm's `KVCache` that way and runs cuDNN over
the whole buffer with a padding mask). Any other length, and the same step
runs the vector kernel.

So before each L=1 step (`keep_vector_decode`), a layer whose buffer length
is a multiple of `CUDNN_DECODE_STEP` gets `PAD` more empty slots at its end.
Nothing reads them: the cache's offset is unchanged, the attention sees
`keys[..., :offset, :]` as before (same values, other strides), and mlx-lm's
own growth keeps the length off the multiple afterwards (a full buffer grows
by 256 more). Merges, extends and extractions make new buffers of any length;
the next step checks again. Prefill chunks are left alone: on the shape grid
their buffers end at the chunk's end, so the keys' strides repeat with the
shapes and cuDNN's plans are reused.

Off (the default, and always on the CPU) `keep_vector_decode` returns at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

# MLX runs a length-1 query on cuDNN only over a buffer of a multiple of this many slots.
CUDNN_DECODE_STEP = 256
# Empty slots added to such a buffer; any number off the multiple would do. 8 keeps each head's rows
# 16-byte aligned whatever the head dimension, and costs 8 tokens of KV.
PAD = 8

_active = False


def set_active(on: bool) -> None:
    """Turn the layout on or off for the process (the lease thread does, once it chose the backend)."""
    global _active
    _active = on


def is_active() -> bool:
    return _active


def keep_vector_decode(caches: Sequence[Any]) -> None:
    """Before a decode (L=1) step over `caches`: pad each buffer MLX would run on cuDNN (see above).

    Plain `KVCache` layers and mlx-lm batch caches (`BatchKVCache` and its subclasses) are padded;
    rotating, quantized and recurrent layers are left as they are. In place; lazy (the pad is part
    of the step's graph). A no-op unless `set_active(True)`.
    """
    if not _active:
        return
    for cache in caches:
        keys = getattr(cache, "keys", None)
        if not isinstance(keys, mx.array) or keys.shape[2] % CUDNN_DECODE_STEP:
            continue
        if type(cache) is KVCache or isinstance(cache, BatchKVCache):
            cache.keys, cache.values = _padded(keys), _padded(cache.values)


def _padded(buffer: mx.array) -> mx.array:
    """`buffer` `[B, H, T, D]` with `PAD` zero slots after its `T`."""
    b, h, _, d = buffer.shape
    return mx.concatenate([buffer, mx.zeros((b, h, PAD, d), buffer.dtype)], axis=2)
