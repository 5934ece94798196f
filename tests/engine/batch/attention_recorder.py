"""A model stand-in that records what each attention call of a forward would get: query length, keys, buffer, mask.

Every layer writes the chunk's keys into its mlx-lm cache (`update_and_fetch`, the
real growth and slicing) and records (query tokens, keys attended, the keys'
buffer length, the mask kind): MLX's CUDA backend plans cuDNN by exactly those
(the buffer length fixes the keys' strides; docs/design.md §4.6). Python sees
no strides, so the buffer length stands for them. Cheap: zeros of a few heads.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
from mlx_lm.models.base import create_attention_mask


@attrs.frozen(order=True)
class AttentionCall:
    queries: int
    keys: int
    buffer: int  # the keys' buffer length: with its head count and dim, their strides
    mask: str  # "causal", "none" or "array"


class RecordingModel:
    """`model(inputs [1, n], cache=...)` as mlx-lm's models are called; records `calls`."""

    def __init__(self, layers: int = 2, heads: int = 2, dim: int = 8, vocab: int = 16) -> None:
        self.layers = [None] * layers  # make_prompt_cache makes one KVCache per layer
        self._heads, self._dim, self._vocab = heads, dim, vocab
        self.calls: list[AttentionCall] = []

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        n = inputs.shape[1]
        mask = create_attention_mask(mx.zeros((1, n, 1)), cache[0])
        kind = mask if isinstance(mask, str) else "none" if mask is None else "array"
        for layer in cache:
            kv = mx.zeros((1, self._heads, n, self._dim), mx.float16)
            keys, _ = layer.update_and_fetch(kv, kv)
            self.calls.append(AttentionCall(n, keys.shape[2], layer.keys.shape[2], kind))
        return mx.zeros((1, n, self._vocab))

    def take_calls(self) -> list[AttentionCall]:
        calls, self.calls = self.calls, []
        return calls
