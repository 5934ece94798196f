"""A model's paged KV: rows as block tables over one block pool, and the forwards that run on them.

`PagedKV` is a model's pool (pool.py), its arrays (storage.py) and its chain
roots (chain.py). A `PagedRow` (row.py) is what one sequence holds: its blocks,
its length and the token ids known so far. A batch is nothing but a list of
rows: a row joins or leaves by being put in or taken out of that list, and no
KV moves (each row's KV stays in its own blocks).

A forward over rows (`forward`, or `step` + the model + `commit`) feeds every
row the same number `L` of new positions: `step` makes sure each row's table
has blocks for them (allocated for all rows at once, or `PoolExhausted` and
nothing allocated), and builds the step's arrays once for all layers
(step.py). `caches(step)` are the `PagedLayerCache`s (layer_cache.py) that
mlx-lm's model takes as its cache list; `row_caches(row)` serve code that
calls the model with a lone row's per-layer caches (the chunked prefill).
`commit` advances the rows and keys every block now full of known tokens, so
a later row whose prompt starts with the same tokens references it (`join`,
and `catch_up` before each prefill chunk).

A row's prefix match leaves at least its last prompt token to prefill (the
forward that computes the first logits needs one), and only full blocks are
shared, so a row never writes into a block another row reads (`truncate`
copies one first).

Lease thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_trio.engine.kv.blocks.chain import Key, block_key, chain_keys, root_key
from mlx_trio.engine.kv.blocks.layer_cache import PagedLayerCache, PagedRowCache, RowForward
from mlx_trio.engine.kv.blocks.pool import BlockPool, PoolExhausted, PoolStats
from mlx_trio.engine.kv.blocks.row import PagedRow
from mlx_trio.engine.kv.blocks.step import PagedStep, build_groups
from mlx_trio.engine.kv.blocks.storage import BlockStorage


@attrs.define(eq=False)
class PrefixPin:
    """References to the cached blocks a queued request's prompt starts with (`PagedKV.pin_prefix`), held until
    its row takes them over (`join`) or it is dropped (`unpin`); `taken` once either happened."""

    blocks: list[int]
    keys: list[Key]
    root: Key
    taken: bool = False


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
        # Called (lease thread) with a leaving row's adapter revision ("": the base model's), the tokens of its keyed
        # blocks and their keys, before they become evictable: the SSD tier's writer (actors/block_persistence.py)
        # must not block here.
        self.on_release: Callable[[str, tuple[int, ...], tuple[Key, ...]], None] | None = None

    # -- rows ---------------------------------------------------------------------------------------

    def root_of(self, adapter_revision: str = "") -> Key:
        """The chain root of rows computed with this adapter revision ("": the base model): blocks of one adapter
        never serve the base model or another adapter (or another revision of it)."""
        root = self._roots.get(adapter_revision)
        if root is None:
            root = self._roots[adapter_revision] = root_key(self.model_identity, adapter_revision)
        return root

    def pin_prefix(self, prompt: Sequence[int], adapter_revision: str = "") -> PrefixPin:
        """Retain the cached full blocks `prompt` starts with (those `join` would find), so they cannot be evicted
        between admission crediting them and the row joining: `join(..., pin=)` takes the references over, or
        `unpin` drops them (a request dropped before it joined). A pin holds no byte admission must reserve."""
        root = self.root_of(adapter_revision)
        keys = chain_keys(root, list(prompt[: max(0, len(prompt) - 1)]), self.block_size)
        blocks = self.pool.lookup(keys)
        for block in blocks:
            self.pool.retain(block)
        return PrefixPin(blocks, keys[: len(blocks)], root)

    def unpin(self, pin: PrefixPin) -> None:
        """Drop a pin no row took over; idempotent, and a no-op once `join` took it."""
        if not pin.taken:
            pin.taken = True
            self.pool.release(pin.blocks)

    def blocks_to_allocate(self, num_tokens: int, pin: PrefixPin | None = None) -> int:
        """Blocks a row of `num_tokens` positions allocates at most when it joins with `pin`: the pinned prefix is
        referenced, not allocated (admission's credit for a cached prefix)."""
        return -(-num_tokens // self.block_size) - (len(pin.blocks) if pin is not None else 0)

    def starts_cached(self, prompt: Sequence[int], adapter_revision: str = "") -> bool:
        """Whether a row of `prompt` under `adapter_revision` ("": the base model) would find its first full block
        cached (`join` would reference it).

        A read of the pool's key map, so callable off the lease thread (admission's pre-check, the prefill actor's
        cohort choice): the answer may be stale by the time a row joins, which changes what it computes, never
        what it holds."""
        if len(prompt) - 1 < self.block_size:
            return False
        root = self.peek_root(adapter_revision)
        return bool(self.pool.lookup(chain_keys(root, list(prompt[: self.block_size]), self.block_size)))

    def peek_root(self, adapter_revision: str = "") -> Key:
        """`root_of(adapter_revision)` computed, not remembered (`root_of` writes its map: lease thread only), so
        callable off the lease thread."""
        return self._roots.get(adapter_revision) or root_key(self.model_identity, adapter_revision)

    def join(self, prompt: Sequence[int], adapter_revision: str = "", pin: PrefixPin | None = None) -> PagedRow:
        """A new row for `prompt`, referencing the cached full blocks its prompt starts with (all but its last token
        may be found); `prompt[row.length:]` is left to prefill. `adapter_revision`: the row's adapter's, if any.
        `pin` (from `pin_prefix` of the same prompt and revision): its references become the row's, and the
        lookup goes on past them (blocks cached since it was pinned)."""
        root = self.root_of(adapter_revision)
        keys = chain_keys(root, list(prompt[: max(0, len(prompt) - 1)]), self.block_size)
        blocks: list[int] = []
        if pin is not None:
            # Never joined silently: a pin of another root holds blocks of another revision's KV (wrong tokens),
            # and its row would allocate what admission credited (over the reservation).
            if pin.root != root:
                raise ValueError(f"a pin made under another adapter revision reached a row of {adapter_revision!r}")
            if pin.taken or pin.keys != keys[: len(pin.keys)]:
                raise ValueError("a pin is taken once, by a row of the prompt and adapter it was made for")
            pin.taken = True
            blocks = list(pin.blocks)
        found = self.pool.lookup(keys[len(blocks):])
        for block in found:
            self.pool.retain(block)
        blocks += found
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
            hook = self.on_release
            if hook is not None and row.keys:
                # The row's root back to its revision: one entry a revision this pool has served (a few).
                revision = next((r for r, root in self._roots.items() if root == row.root), None)
                if revision is not None:
                    hook(revision, tuple(row.tokens[: len(row.keys) * self.block_size]), tuple(row.keys))
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

    def step(self, rows: Sequence[PagedRow], queries: int, dummies: int = 0) -> PagedStep:
        """Blocks for `queries` new positions after each row's KV, and the step's arrays (see the module docstring).

        `dummies`: padding queries after a lone row's real ones, attended but never written (`build_groups`)."""
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
        groups, restore = build_groups(rows, L, bs, dummies)
        return PagedStep(tuple(rows), L, groups, restore, mx.array(slots, dtype=mx.int32), offset)

    def caches(self, step: PagedStep) -> list[PagedLayerCache]:
        return [PagedLayerCache(self, i, step) for i in range(len(self.storage.layers))]

    def row_caches(self, row: PagedRow) -> list[PagedRowCache]:
        """One row's caches for mlx-lm's per-layer protocol (see the module docstring); one forward at a time."""
        forward = RowForward(self, row)
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
