"""One sequence's place in a block pool: the blocks holding its KV, its length, the token ids known so far."""

from __future__ import annotations

import attrs
import numpy as np

from mlx_trio.engine.kv.blocks.chain import Key


@attrs.define(eq=False)
class PagedRow:
    """One sequence's KV: `blocks` hold the KV of its first `length` positions (position `p` in block
    `p // block_size`); `tokens` are the ids of its positions known on the host so far, from the start (a
    prompt is known before it is prefilled; a decode batch learns a step's token after queueing the next
    step): they may run ahead of `length` or lag it, and a block is keyed once both cover it."""

    tokens: list[int] = attrs.field(factory=list)
    blocks: list[int] = attrs.field(factory=list)
    keys: list[Key] = attrs.field(factory=list)  # chain keys of its first len(keys) (full) blocks
    root: Key = b""  # its chain's root: the model and the row's adapter revision (`PagedKV.root_of`)
    length: int = 0
    cached_tokens: int = 0  # prompt tokens its join found in shared blocks
    released: bool = False
    # `blocks` mirrored in a growing int32 array (blocks are only appended while a row lives): a step copies
    # each row's table with one numpy slice, not one Python int a block (B=64 rows of 12.6k tokens: 790 each).
    _table: np.ndarray = attrs.field(factory=lambda: np.zeros(16, np.int32), repr=False)
    _mirrored: int = attrs.field(default=0, repr=False)

    def table(self) -> np.ndarray:
        """`blocks` as an int32 array (a view, valid until the next allocation)."""
        n = len(self.blocks)
        if n < self._mirrored:  # the list was replaced: mirror it again
            self._mirrored = 0
        if n > len(self._table):
            grown = np.zeros(max(n, 2 * len(self._table)), np.int32)
            grown[: self._mirrored] = self._table[: self._mirrored]
            self._table = grown
        if n > self._mirrored:
            self._table[self._mirrored : n] = self.blocks[self._mirrored : n]
            self._mirrored = n
        return self._table[:n]
