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

import attrs
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
        L, lead = self.step.queries, self.step.lead
        if keys.shape[2] > L:  # positions around the new ones (`RowForward.lead`, `.dummies`): never written
            keys, values = keys[..., lead : lead + L, :], values[..., lead : lead + L, :]
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

    Set by the prefill for its next forward on the shape grid (engine/batch/chunked_prefill.py): `lead`,
    how many of the row's last positions (already in its blocks) come again as its first queries, and
    `dummies`, how many padding positions follow the new ones. Both are attended, so the attention has a
    grid shape, and neither is written, allocated, keyed or counted in the row's length: the lead's K/V are
    the row's own (its blocks stay as they are, shared ones shared), the dummies' keys the row's first.
    """

    __slots__ = ("dummies", "kv", "lead", "row", "step")

    def __init__(self, kv: PagedKV, row: PagedRow) -> None:
        self.kv, self.row = kv, row
        self.step: PagedStep | None = None
        self.lead = 0
        self.dummies = 0


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
    advances the row (its attention still reads the step). Its offset is the row's length (less a lead), an
    int, as mlx-lm's `KVCache`'s. A forward that fails between the two leaves the row's length where it was.
    """

    def __init__(self, kv: PagedKV, layer: int, forward: RowForward) -> None:
        self.kv, self.layer, self._forward = kv, layer, forward

    @property  # type: ignore[override]
    def step(self) -> PagedStep:
        assert self._forward.step is not None, "a row cache is read before its forward wrote it"
        return self._forward.step

    @property
    def offset(self) -> int:
        return self._forward.row.length - self._forward.lead

    @property
    def row(self) -> PagedRow:
        return self._forward.row

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        forward = self._forward
        if self.layer == 0:
            step = self.kv.step([forward.row], keys.shape[2] - forward.lead - forward.dummies, forward.dummies)
            forward.step = attrs.evolve(step, lead=forward.lead) if forward.lead else step
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
