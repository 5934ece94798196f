"""The cache objects mlx-lm's attention modules are called with on paged KV.

`PagedLayerCache` is one layer's view of a built step (a batch's forward);
`PagedRowCache` is one layer of a lone row for code that calls the model with
per-layer caches across forwards (prefill chunks, token 0): its first layer's
`update_and_fetch` builds the step, its last one's commits it. Neither returns
K/V to attend over: the routed attention recognises them and reads the blocks
(engine/attention/paged_attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_trio.engine.kv.blocks.row import PagedRow
from mlx_trio.engine.kv.blocks.step import PagedStep

if TYPE_CHECKING:
    from mlx_trio.engine.kv.blocks.paged_kv import PagedKV


class PagedLayerCache:
    """Layer `layer`'s view of a `PagedStep`: the cache object mlx-lm's attention module is called with.

    `update_and_fetch` writes the step's new K/V into the blocks and returns them unchanged (the routed
    attention reads the blocks, not its return); `make_mask` is None (the paged attention masks by length).
    """

    def __init__(self, kv: PagedKV, layer: int, step: PagedStep) -> None:
        self.kv, self.layer, self.step = kv, layer, step

    @property
    def offset(self) -> int | mx.array:
        return self.step.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        L = self.step.queries
        if keys.shape[2] > L:  # dummy positions after the real ones (`RowForward.dummies`): never written
            keys, values = keys[..., :L, :], values[..., :L, :]
        self.kv.storage.write(self.layer, self.step.slots, keys, values)
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> None:
        if window_size is not None:
            raise ValueError("paged KV holds full-attention layers only; a sliding window keeps its own layout")
        return None

    @property
    def block_keys(self) -> mx.array:
        return self.kv.storage.keys[self.layer]

    @property
    def block_values(self) -> mx.array:
        return self.kv.storage.values[self.layer]


class RowForward:
    """The step of a lone row's forward in progress, shared by its `PagedRowCache` layers.

    `dummies`: how many of the next forward's last positions are padding (the prefill shape grid,
    engine/batch/chunked_prefill.py). They are attended, so the attention has the grid's shape, but never
    written, allocated, keyed or counted in the row's length: nothing is left to trim.
    """

    __slots__ = ("dummies", "kv", "row", "step")

    def __init__(self, kv: PagedKV, row: PagedRow) -> None:
        self.kv, self.row = kv, row
        self.step: PagedStep | None = None
        self.dummies = 0

    def step_back(self, n: int) -> None:
        """Give back the row's last `n` positions, whole blocks of its prompt (references dropped, nothing
        copied), to be prefilled again: so a prefill starts on the shape grid (engine/batch/chunked_prefill.py).
        The prompt's ids stay known, so the blocks are keyed again once recomputed."""
        if n <= 0:
            return
        row = self.row
        if n > row.length or (row.length - n) % self.kv.block_size:
            raise ValueError(f"a row of {row.length} positions steps back whole blocks, not {n} positions")
        known = row.tokens[row.length - n :]
        self.kv.truncate(row, n)  # drops the ids past the new length too (a speculative tail's): put them back
        row.tokens.extend(known)
        self.kv.reused_tokens -= min(n, self.kv.reused_tokens)


def row_forward_of(caches: Sequence[Any]) -> RowForward | None:
    """The lone row's forward `caches` share when they are one paged row's (`PagedKV.row_caches`), else None."""
    if caches and all(type(c) is PagedRowCache for c in caches):
        forward = caches[0]._forward
        if all(c._forward is forward for c in caches):
            return forward
    return None


class PagedRowCache(PagedLayerCache):
    """Layer `layer` of one row, for code that calls the model with per-layer caches (prefill chunks, token 0).

    The first layer's `update_and_fetch` allocates the forward's blocks and builds its step; the last one's
    advances the row (its attention still reads the step). Its offset is the row's length, an int, as
    mlx-lm's `KVCache`'s. A forward that fails between the two leaves the row's length where it was.
    """

    def __init__(self, kv: PagedKV, layer: int, forward: RowForward) -> None:
        self.kv, self.layer, self._forward = kv, layer, forward

    @property  # type: ignore[override]
    def step(self) -> PagedStep:
        assert self._forward.step is not None, "a row cache is read before its forward wrote it"
        return self._forward.step

    @property
    def offset(self) -> int:
        return self._forward.row.length

    @property
    def row(self) -> PagedRow:
        return self._forward.row

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        forward = self._forward
        if self.layer == 0:
            forward.step = self.kv.step([forward.row], keys.shape[2] - forward.dummies, forward.dummies)
        out = super().update_and_fetch(keys, values)
        if self.layer == len(self.kv.storage.layers) - 1:
            self.kv.commit(self.step)
        return out

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The layer's block arrays: what to evaluate after a forward (mlx-lm evaluates `cache.state`)."""
        return self.block_keys, self.block_values

    @property
    def nbytes(self) -> int:
        """This layer's share of the row's blocks."""
        shape = self.kv.storage.layers[self.layer]
        return (2 * len(self.row.blocks) * self.kv.block_size * shape.kv_heads * shape.head_dim
                * self.kv.storage.dtype.size)
