"""Rows as block tables over one model's block pool, and the per-layer cache mlx-lm's forward runs on.

`PagedKV` is a model's pool (pool.py), its arrays (storage.py) and its chain
root (chain.py). A `PagedRow` is what one sequence holds: the token ids whose
KV is in its blocks, in order, and the chain keys of its full blocks. A batch
is nothing but a list of rows: a row joins or leaves by being put in or taken
out of that list, and no KV moves (each row's KV stays in its own blocks).

A forward over rows (`PagedKV.forward`, or `step` + the model + `commit`)
feeds every row the same number `L` of new tokens: `step` makes sure each
row's table has blocks for its new positions (allocated for all rows at once,
or `PoolExhausted` and nothing allocated), and builds the step's arrays once
for all layers: the block tables, each row's length after the step, the slots
its new tokens go to and the RoPE offsets. `caches()` are `PagedLayerCache`s
that mlx-lm's model takes as its cache list: `update_and_fetch` writes the new
K/V into the layer's blocks, and the routed attention (engine/attention/
routed_attention.py) recognises the cache and attends over the row's blocks
(engine/attention/paged_attention.py) instead of over returned K/V. `commit`
advances the rows and keys every block that became full, so a later row whose
prompt starts with the same tokens references it (`join`).

A row's prefix match leaves at least its last prompt token to prefill (the
forward that computes the first logits needs one), and only full blocks are
shared, so a row never writes into a block another row reads.

Lease thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx

from mlx_trio.engine.kv.blocks.chain import Key, block_key, chain_keys, root_key
from mlx_trio.engine.kv.blocks.pool import BlockPool, PoolExhausted, PoolStats
from mlx_trio.engine.kv.blocks.storage import BlockStorage


@attrs.define(eq=False)
class PagedRow:
    """One sequence's KV: `blocks` hold the KV of `tokens` (position `p` in block `p // block_size`)."""

    tokens: list[int] = attrs.field(factory=list)
    blocks: list[int] = attrs.field(factory=list)
    keys: list[Key] = attrs.field(factory=list)  # chain keys of its first len(keys) (full) blocks
    cached_tokens: int = 0  # prompt tokens its join found in shared blocks
    released: bool = False

    @property
    def length(self) -> int:
        return len(self.tokens)


@attrs.frozen(eq=False)
class PagedStep:
    """One forward's arrays, built once for every layer: see `PagedKV.step`."""

    rows: tuple[PagedRow, ...]
    new_tokens: tuple[tuple[int, ...], ...]
    tables: mx.array  # [B, max blocks] int32; past a row's own blocks, block 0 (never read: masked by length)
    lengths: mx.array  # [B] int32: each row's KV length once this step's tokens are written
    slots: mx.array  # [B * L] int32: where each new token's K/V goes in the flat block view
    offset: int | mx.array  # RoPE offset: an int for one row (as mlx-lm's KVCache), else per row [B]

    @property
    def queries(self) -> int:
        return len(self.new_tokens[0])


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


class PagedKV:
    """A model's paged KV: blocks, their arrays and the chain root (model identity + adapter revision)."""

    def __init__(self, storage: BlockStorage, model_identity: str, adapter_revision: str = "") -> None:
        self.storage = storage
        self.block_size = storage.block_size
        self.pool = BlockPool(storage.num_blocks)
        self.root = root_key(model_identity, adapter_revision)

    # -- rows ---------------------------------------------------------------------------------------

    def join(self, prompt: Sequence[int]) -> PagedRow:
        """A new row for `prompt`, referencing the cached full blocks its prompt starts with (all but its last token
        may be found); its `tokens` are what they hold, and `prompt[row.length:]` is left to prefill."""
        keys = chain_keys(self.root, list(prompt[: max(0, len(prompt) - 1)]), self.block_size)
        blocks = self.pool.lookup(keys)
        for block in blocks:
            self.pool.retain(block)
        cached = len(blocks) * self.block_size
        return PagedRow(list(prompt[:cached]), blocks, keys[: len(blocks)], cached)

    def leave(self, row: PagedRow) -> None:
        """Release the row's blocks (its keyed full blocks stay cached for later rows); idempotent."""
        if not row.released:
            row.released = True
            self.pool.release(row.blocks)
            row.blocks = []

    # -- a forward ----------------------------------------------------------------------------------

    def step(self, rows: Sequence[PagedRow], new_tokens: Sequence[Sequence[int]]) -> PagedStep:
        """Blocks for `new_tokens[b]` after each row's KV (the same count per row), and the step's arrays."""
        if len(rows) != len(new_tokens) or not rows:
            raise ValueError(f"{len(rows)} rows and {len(new_tokens)} token lists: one list per row, at least one row")
        L = len(new_tokens[0])
        if L < 1 or any(len(t) != L for t in new_tokens):
            raise ValueError("every row of a forward takes the same positive number of new tokens")
        bs = self.block_size
        wanted = [-(-(row.length + L) // bs) - len(row.blocks) for row in rows]
        need = sum(max(0, w) for w in wanted)
        if need > self.pool.available():  # all or nothing: no row keeps half a step's blocks
            raise PoolExhausted(f"{need} KV blocks wanted, {self.pool.available()} free or evictable")
        for row, w in zip(rows, wanted):
            if w > 0:
                row.blocks.extend(self.pool.allocate(w))
        width = max(len(row.blocks) for row in rows)
        tables = [row.blocks + [0] * (width - len(row.blocks)) for row in rows]
        slots = [row.blocks[p // bs] * bs + p % bs for row in rows for p in range(row.length, row.length + L)]
        offset: int | mx.array = (rows[0].length if len(rows) == 1
                                  else mx.array([row.length for row in rows], dtype=mx.int32))
        return PagedStep(tuple(rows), tuple(tuple(t) for t in new_tokens), mx.array(tables, dtype=mx.int32),
                         mx.array([row.length + L for row in rows], dtype=mx.int32),
                         mx.array(slots, dtype=mx.int32), offset)

    def caches(self, step: PagedStep) -> list[PagedLayerCache]:
        return [PagedLayerCache(self, i, step) for i in range(len(self.storage.layers))]

    def commit(self, step: PagedStep) -> None:
        """The step's tokens are in the rows' blocks: advance the rows and key every block that became full."""
        bs = self.block_size
        for row, tokens in zip(step.rows, step.new_tokens):
            row.tokens.extend(tokens)
            parent = row.keys[-1] if row.keys else self.root
            for index in range(len(row.keys), row.length // bs):
                parent = block_key(parent, row.tokens[index * bs : (index + 1) * bs])
                self.pool.register(row.blocks[index], parent)  # False: another block has it; ours stays unkeyed
                row.keys.append(parent)

    def forward(self, model: Any, rows: Sequence[PagedRow], new_tokens: Sequence[Sequence[int]]) -> mx.array:
        """The model's logits `[B, L, vocab]` for `new_tokens` after each row's KV, evaluated, the rows advanced."""
        step = self.step(rows, new_tokens)
        logits = model(mx.array([list(t) for t in new_tokens], dtype=mx.int32), cache=self.caches(step))
        mx.eval(logits, self.storage.keys, self.storage.values)
        self.commit(step)
        return logits

    # -- accounting ---------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def bytes_in_use(self) -> int:
        """KV bytes the rows hold: blocks in use (each counted once, however many rows share it) × block bytes."""
        return self.pool.stats().used * self.storage.bytes_per_block
