"""The arrays behind a block pool: one K and one V array per full-attention layer, allocated once at load.

Layout `[num_blocks, block_size, kv_heads, head_dim]`: a block is one
contiguous run, and viewed as `[num_blocks * block_size, kv_heads, head_dim]`
a token's KV is one row at `block * block_size + offset` (its slot), so a
forward writes its new tokens with one scatter a layer and the reference
attention gathers a row's blocks with one take a layer
(engine/attention/paged_reference.py). The arrays start as zeros and are only
ever written with finite K/V, so the unwritten tail of a block, masked out by
the attention, never turns a zero weight into NaN.

Lease thread only (MLX).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx

# Tokens per block unless the model's load says otherwise. Chosen on the CPU (benchmarks/paged_kv.py, its `block` part:
# the tiny models' decode step is flat from 16 to 64 and a 16-token block wastes at most 15 tokens a row);
# an H200 measurement is to choose it for CUDA (docs/design.md §6.5).
DEFAULT_BLOCK_SIZE = 16


@attrs.frozen
class LayerShape:
    """One full-attention layer's KV head count and head size."""

    kv_heads: int
    head_dim: int


class BlockStorage:
    """`keys[i]` / `values[i]`: layer `i`'s blocks; replaced (functionally) by each write."""

    def __init__(self, layers: Sequence[LayerShape], num_blocks: int, block_size: int, dtype: mx.Dtype) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size and num_blocks must be positive, got {block_size} and {num_blocks}")
        self.layers = tuple(layers)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.keys = [mx.zeros((num_blocks, block_size, s.kv_heads, s.head_dim), dtype) for s in self.layers]
        self.values = [mx.zeros((num_blocks, block_size, s.kv_heads, s.head_dim), dtype) for s in self.layers]
        mx.eval(self.keys, self.values)

    @staticmethod
    def block_bytes(layers: Sequence[LayerShape], block_size: int, dtype: mx.Dtype) -> int:
        """Bytes one block takes across all layers, K and V."""
        return 2 * block_size * dtype.size * sum(s.kv_heads * s.head_dim for s in layers)

    @classmethod
    def from_budget(cls, layers: Sequence[LayerShape], budget_bytes: int, block_size: int,
                    dtype: mx.Dtype) -> BlockStorage:
        """As many blocks as fit in `budget_bytes` (at least one)."""
        return cls(layers, max(1, budget_bytes // cls.block_bytes(layers, block_size, dtype)), block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes(self.layers, self.block_size, self.dtype)

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Put `keys`/`values` `[B, kv_heads, L, head_dim]` at `slots` `[B * L]` (row-major: row, then position)."""
        shape = self.keys[layer].shape
        flat = (shape[0] * shape[1], shape[2], shape[3])
        B, H, L, D = keys.shape
        k = self.keys[layer].reshape(flat)
        v = self.values[layer].reshape(flat)
        k[slots] = keys.transpose(0, 2, 1, 3).reshape(B * L, H, D).astype(self.dtype)
        v[slots] = values.transpose(0, 2, 1, 3).reshape(B * L, H, D).astype(self.dtype)
        self.keys[layer] = k.reshape(shape)
        self.values[layer] = v.reshape(shape)
