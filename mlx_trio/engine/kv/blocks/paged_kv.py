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

A lone row's prefill can also run through mlx-lm's ordinary per-layer cache
protocol: `row_caches(row)` are `PagedRowCache`s whose first layer's
`update_and_fetch` builds the step for however many tokens came and whose last
layer's commits it, so any code that calls `model(tokens, cache=caches)`
(engine/batch/chunked_prefill.py) prefills into blocks unchanged.

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
import numpy as np

from mlx_trio.engine.kv.blocks.chain import Key, block_key, chain_keys, root_key
from mlx_trio.engine.kv.blocks.pool import BlockPool, PoolExhausted, PoolStats
from mlx_trio.engine.kv.blocks.storage import BlockStorage


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


# A step's rows are attended in groups of similar table widths, each gathered to its own widest row: one
# group's widest table is at most this many times its narrowest, so the gather's transient is at most about
# this many times the KV the rows hold (one long row beside many short ones is never padded to the long one).
GROUP_WIDTH_RATIO = 2


@attrs.frozen(eq=False)
class StepGroup:
    """Rows of a step whose tables are of similar width, attended together."""

    index: mx.array | None  # the rows' places in the step's batch (None: all rows, in order)
    tables: mx.array  # [G, widest] int32; past a row's own blocks, its first block (never read: masked by length)
    lengths: mx.array  # [G] int32: each row's KV length once this step's tokens are written


@attrs.frozen(eq=False)
class PagedStep:
    """One forward's arrays, built once for every layer: see `PagedKV.step`."""

    rows: tuple[PagedRow, ...]
    queries: int  # new positions per row (L)
    groups: tuple[StepGroup, ...]
    restore: mx.array | None  # the batch order of the groups' rows concatenated (None: already in order)
    slots: mx.array  # [B * L] int32: where each new token's K/V goes in the flat block view
    offset: int | mx.array  # RoPE offset: an int for one row (as mlx-lm's KVCache), else per row [B]


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


def width_groups(widths: Sequence[int], ratio: int = GROUP_WIDTH_RATIO) -> list[list[int]]:
    """Row indices grouped by table width, narrowest first: in each group the widest is at most `ratio` x the
    narrowest (equal widths: one group)."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and widths[i] <= ratio * max(1, widths[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _groups(rows: Sequence[PagedRow], L: int) -> tuple[tuple[StepGroup, ...], mx.array | None]:
    out = []
    grouped = width_groups([len(row.blocks) for row in rows])
    for members in grouped:
        width = max(len(rows[i].blocks) for i in members)
        tables = np.empty((len(members), width), np.int32)
        for k, i in enumerate(members):
            own = rows[i].table()
            tables[k, : len(own)] = own
            tables[k, len(own) :] = own[0]  # past its own blocks: any block of its own (masked by length)
        index = None if len(grouped) == 1 and members == sorted(members) else mx.array(members, dtype=mx.int32)
        out.append(StepGroup(index, mx.array(tables),
                             mx.array([rows[i].length + L for i in members], dtype=mx.int32)))
    order = [i for members in grouped for i in members]
    restore = None
    if order != list(range(len(rows))):
        back = [0] * len(order)
        for position, i in enumerate(order):
            back[i] = position
        restore = mx.array(back, dtype=mx.int32)
    return tuple(out), restore


class _RowForward:
    """The step of a lone row's forward in progress, shared by its `PagedRowCache` layers."""

    __slots__ = ("kv", "row", "step")

    def __init__(self, kv: PagedKV, row: PagedRow) -> None:
        self.kv, self.row = kv, row
        self.step: PagedStep | None = None


class PagedRowCache(PagedLayerCache):
    """Layer `layer` of one row, for code that calls the model with per-layer caches (prefill chunks, token 0).

    The first layer's `update_and_fetch` allocates the forward's blocks and builds its step; the last one's
    advances the row (its attention still reads the step). Its offset is the row's length, an int, as
    mlx-lm's `KVCache`'s. A forward that fails between the two leaves the row's length where it was.
    """

    def __init__(self, kv: PagedKV, layer: int, forward: _RowForward) -> None:
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
            forward.step = self.kv.step([forward.row], keys.shape[2])
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


class PagedKV:
    """A model's paged KV: blocks, their arrays and the chain root (model identity + adapter revision)."""

    def __init__(self, storage: BlockStorage, model_identity: str, adapter_revision: str = "") -> None:
        self.storage = storage
        self.block_size = storage.block_size
        self.pool = BlockPool(storage.num_blocks)
        self.model_identity = model_identity
        self.root = root_key(model_identity, adapter_revision)
        self._roots = {adapter_revision: self.root}
        self.reused_tokens = 0  # prompt tokens rows found in cached blocks (not prefilled), since load

    # -- rows ---------------------------------------------------------------------------------------

    def root_of(self, adapter_revision: str = "") -> Key:
        """The chain root of rows computed with this adapter revision ("": the base model): blocks of one adapter
        never serve the base model or another adapter (or another revision of it)."""
        root = self._roots.get(adapter_revision)
        if root is None:
            root = self._roots[adapter_revision] = root_key(self.model_identity, adapter_revision)
        return root

    def join(self, prompt: Sequence[int], adapter_revision: str = "") -> PagedRow:
        """A new row for `prompt`, referencing the cached full blocks its prompt starts with (all but its last token
        may be found); `prompt[row.length:]` is left to prefill. `adapter_revision`: the row's adapter's, if any."""
        root = self.root_of(adapter_revision)
        keys = chain_keys(root, list(prompt[: max(0, len(prompt) - 1)]), self.block_size)
        blocks = self.pool.lookup(keys)
        for block in blocks:
            self.pool.retain(block)
        cached = len(blocks) * self.block_size
        self.reused_tokens += cached
        return PagedRow(list(prompt), blocks, keys[: len(blocks)], root, cached, cached)

    def catch_up(self, row: PagedRow) -> int:
        """Reference the cached blocks that continue the row's prompt past its length (another row prefilled them
        since this one joined); returns the positions gained. Only from a block boundary, and never the prompt's
        last token (as `join`). Siblings prefilling one prefix side by side so leapfrog: each computes the chunk
        the others have not, and the prefix is computed about once."""
        bs = self.block_size
        if row.length % bs or len(row.keys) != len(row.blocks):
            return 0
        gained = 0
        parent = row.keys[-1] if row.keys else row.root or self.root
        while row.length + bs <= len(row.tokens) - 1:
            key = block_key(parent, row.tokens[row.length : row.length + bs])
            found = self.pool.lookup([key])
            if not found:
                break
            self.pool.retain(found[0])
            row.blocks.append(found[0])
            row.keys.append(key)
            row.length += bs
            gained += bs
            parent = key
        self.reused_tokens += gained
        return gained

    def adopt(self, caches: Sequence[Any], tokens: Sequence[int], adapter_revision: str = "") -> PagedRow:
        """A new row holding a prefilled row's KV (mlx-lm `KVCache`s, one a full-attention layer, `tokens` in them),
        copied into fresh blocks: the row's own KV only, one scatter a layer. Raises PoolExhausted (nothing held)."""
        length = int(caches[0].offset)
        row = PagedRow(root=self.root_of(adapter_revision))
        if length:
            step = self.step([row], length)
            for layer, cache in enumerate(caches):
                self.storage.write(layer, step.slots, cache.keys[..., :length, :], cache.values[..., :length, :])
            self.commit(step)
        self.note_tokens(row, tokens[:length])
        return row

    def extract(self, row: PagedRow, length: int | None = None) -> list[Any]:
        """The row's first `length` positions (all by default) as fresh mlx-lm `KVCache`s, one a layer (a copy)."""
        from mlx_lm.models.cache import KVCache

        length = row.length if length is None else length
        bs = self.block_size
        out = []
        for layer in range(len(self.storage.layers)):
            cache = KVCache()
            if length:
                blocks = mx.array(row.blocks[: -(-length // bs)], dtype=mx.int32)
                for name, pool in (("keys", self.storage.keys[layer]), ("values", self.storage.values[layer])):
                    kv = mx.take(pool, blocks, axis=0)  # [n, bs, Hkv, D]
                    kv = kv.reshape(-1, kv.shape[2], kv.shape[3])[:length].transpose(1, 0, 2)[None]
                    setattr(cache, name, mx.contiguous(kv))
                cache.offset = length
            out.append(cache)
        return out

    def leave(self, row: PagedRow) -> None:
        """Release the row's blocks (its keyed full blocks stay cached for later rows); idempotent."""
        if not row.released:
            row.released = True
            self.pool.release(row.blocks)
            row.blocks = []

    def truncate(self, row: PagedRow, n: int) -> None:
        """Drop the row's last `n` positions (a speculative step's rejected tail); blocks past its new length go
        back. The row writes into its now-partial last block next, so that block must be its own: a keyed one
        only it holds loses its key (the KV will no longer be what the key names), and one another row reads
        is first copied to a fresh block (PoolExhausted, and nothing changed, if none is free)."""
        if n <= 0:
            return
        if n > row.length:
            raise ValueError(f"cannot drop {n} positions of a row holding {row.length}")
        bs = self.block_size
        length = row.length - n
        keep = -(-length // bs)
        last = row.blocks[keep - 1] if length % bs else None
        copy = last is not None and self.pool.refs(last) > 1
        if copy and not self.pool.available():
            raise PoolExhausted("a shared block must be copied to roll a row back, and no block is free")
        row.length = length
        del row.tokens[length:]
        del row.keys[length // bs :]
        self.pool.release(row.blocks[keep:])
        del row.blocks[keep:]
        if copy:
            assert last is not None
            (new,) = self.pool.allocate(1)
            for arrays in (self.storage.keys, self.storage.values):
                for blocks in arrays:
                    blocks[new] = blocks[last]  # in place: the list's array becomes the copy's result
            self.pool.release([last])
            row.blocks[-1] = new
        elif last is not None:
            self.pool.unregister(last)
        row._mirrored = min(row._mirrored, max(0, len(row.blocks) - 1))

    # -- a forward ----------------------------------------------------------------------------------

    def step(self, rows: Sequence[PagedRow], queries: int) -> PagedStep:
        """Blocks for `queries` new positions after each row's KV, and the step's arrays (see the module docstring)."""
        if not rows or queries < 1:
            raise ValueError(f"a forward needs rows and new positions, got {len(rows)} rows and {queries}")
        bs = self.block_size
        L = queries
        wanted = [-(-(row.length + L) // bs) - len(row.blocks) for row in rows]
        need = sum(max(0, w) for w in wanted)
        if need > self.pool.available():  # all or nothing: no row keeps half a step's blocks
            raise PoolExhausted(f"{need} KV blocks wanted, {self.pool.available()} free or evictable")
        for row, w in zip(rows, wanted):
            if w > 0:
                row.blocks.extend(self.pool.allocate(w))
        if L == 1:  # a decode step: one slot a row
            slots = [row.blocks[row.length // bs] * bs + row.length % bs for row in rows]
        else:
            slots = [row.blocks[p // bs] * bs + p % bs for row in rows for p in range(row.length, row.length + L)]
        offset: int | mx.array = (rows[0].length if len(rows) == 1
                                  else mx.array([row.length for row in rows], dtype=mx.int32))
        groups, restore = _groups(rows, L)
        return PagedStep(tuple(rows), L, groups, restore, mx.array(slots, dtype=mx.int32), offset)

    def caches(self, step: PagedStep) -> list[PagedLayerCache]:
        return [PagedLayerCache(self, i, step) for i in range(len(self.storage.layers))]

    def row_caches(self, row: PagedRow) -> list[PagedRowCache]:
        """One row's caches for mlx-lm's per-layer protocol (see the module docstring); one forward at a time."""
        forward = _RowForward(self, row)
        return [PagedRowCache(self, i, forward) for i in range(len(self.storage.layers))]

    def commit(self, step: PagedStep, new_tokens: Sequence[Sequence[int]] | None = None) -> None:
        """The step's K/V are in the rows' blocks: advance the rows (and note `new_tokens`, one list a row, if known)."""
        for b, row in enumerate(step.rows):
            start = row.length
            row.length += step.queries
            if new_tokens is not None and start <= len(row.tokens) < row.length:
                row.tokens.extend(new_tokens[b][len(row.tokens) - start :])
            self.note_tokens(row, ())

    def note_tokens(self, row: PagedRow, tokens: Sequence[int]) -> None:
        """The next ids of the row's positions are `tokens`: key every block now full of known tokens, so a later
        row whose prompt starts with them references it (`join`)."""
        row.tokens.extend(tokens)
        bs = self.block_size
        parent = row.keys[-1] if row.keys else row.root or self.root
        for index in range(len(row.keys), min(row.length, len(row.tokens)) // bs):
            parent = block_key(parent, row.tokens[index * bs : (index + 1) * bs])
            self.pool.register(row.blocks[index], parent)  # False: another block has it; ours stays unkeyed
            row.keys.append(parent)

    def forward(self, model: Any, rows: Sequence[PagedRow], new_tokens: Sequence[Sequence[int]]) -> mx.array:
        """The model's logits `[B, L, vocab]` for `new_tokens` after each row's KV, evaluated, the rows advanced."""
        if len(rows) != len(new_tokens) or len({len(t) for t in new_tokens}) != 1:
            raise ValueError("one list of new tokens a row, all of one length")
        step = self.step(rows, len(new_tokens[0]))
        logits = model(mx.array([list(t) for t in new_tokens], dtype=mx.int32), cache=self.caches(step))
        mx.eval(logits, self.storage.keys, self.storage.values)
        self.commit(step, new_tokens)
        return logits

    # -- accounting ---------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def row_bytes(self, num_tokens: int) -> int:
        """Bytes of the blocks a row of `num_tokens` positions holds at most (admission's projection)."""
        return -(-num_tokens // self.block_size) * self.storage.bytes_per_block

    @property
    def capacity_bytes(self) -> int:
        return self.storage.num_blocks * self.storage.bytes_per_block

    def counters(self) -> dict[str, int]:
        """What `/stats` shows of the pool: block counts, their size, and the prompt tokens reused."""
        stats = self.pool.stats()
        return {"total": stats.total, "used": stats.used, "shared": stats.shared, "cached": stats.cached,
                "free": stats.free, "block_size": self.block_size, "block_bytes": self.storage.bytes_per_block,
                "prefix_tokens_reused": self.reused_tokens}

    def bytes_held(self, rows: Sequence[PagedRow]) -> int:
        """KV bytes `rows` hold: their distinct blocks (a shared block once) × block bytes."""
        return len({b for row in rows for b in row.blocks}) * self.storage.bytes_per_block

    def bytes_in_use(self) -> int:
        """KV bytes the rows hold: blocks in use (each counted once, however many rows share it) × block bytes."""
        return self.pool.stats().used * self.storage.bytes_per_block
