"""The bookkeeping of a model's KV blocks: free list, refcounts, keys of cached blocks, LRU eviction.

Pure Python, no MLX: the arrays live in `BlockStorage` (storage.py); this
class decides which block id holds what. Every block is in exactly one state:

- free: on the free list, no key, refcount 0;
- used: referenced by one or more rows (refcount > 0), keyed or not;
- cached: refcount 0 but keyed (its KV is the prefix some chain of tokens
  names, chain.py), kept in an LRU so a later row with that prefix can
  reference it instead of prefilling it again.

`allocate` takes free blocks first and evicts the least recently released
cached block only when the free list is empty, so cached prefixes cost
nothing until memory is wanted. A key names one block: a second block
computed for the same key (two rows prefilled the same prefix at once) stays
unkeyed and goes back to the free list when its row releases it.

Contract: every `allocate` / `retain` is balanced by one `release`; then
`idle` holds again (tests check it after every scenario).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import attrs

from mlx_trio.engine.kv.blocks.chain import Key


class PoolExhausted(Exception):
    """Fewer blocks are free or evictable than asked for; nothing was allocated."""


@attrs.frozen
class PoolStats:
    """Block counts: `used` by rows (of them `shared` by more than one), `cached` (unreferenced, keyed), `free`."""

    total: int
    used: int
    shared: int
    cached: int
    free: int


class BlockPool:
    """Ids `0 .. num_blocks-1`; see the module docstring for their states."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # Popped from the end: low ids first, which keeps a small workload's blocks together.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks
        self._key_of: dict[int, Key] = {}
        self._block_of: dict[Key, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently released first
        self._used = 0
        self._shared = 0

    # -- allocation ---------------------------------------------------------------------------------

    def available(self) -> int:
        """Blocks `allocate` can hand out now: free plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, each referenced once (refcount 1, no key); evicts cached blocks only past the free list."""
        if n > self.available():
            raise PoolExhausted(f"{n} KV blocks wanted, {self.available()} free or evictable of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
            self._refs[block] = 1
            out.append(block)
        self._used += n
        return out

    def retain(self, block: int) -> None:
        """One more reference to a used or cached block (a row starts reading a shared prefix)."""
        refs = self._refs[block]
        if refs == 0:
            if block not in self._lru:
                raise ValueError(f"block {block} is free: allocate it, not retain it")
            del self._lru[block]
            self._used += 1
        elif refs == 1:
            self._shared += 1
        self._refs[block] = refs + 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; at none a keyed block is cached (most recent), another freed."""
        for block in blocks:
            refs = self._refs[block]
            if refs <= 0:
                raise ValueError(f"block {block} released more often than referenced")
            self._refs[block] = refs - 1
            if refs == 2:
                self._shared -= 1
            elif refs == 1:
                self._used -= 1
                if block in self._key_of:
                    self._lru[block] = None
                else:
                    self._free.append(block)

    # -- keys ---------------------------------------------------------------------------------------

    def register(self, block: int, key: Key) -> bool:
        """Key a used, unkeyed block that is now full; False (and nothing changes) when `key` names another block."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not in use: only a row's full block can be keyed")
        if block in self._key_of:
            return self._key_of[block] == key
        if key in self._block_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def unregister(self, block: int) -> None:
        """Forget a used block's key (its row is about to write into it); a no-op for an unkeyed block."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not in use: a cached block keeps its key until evicted")
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]

    def lookup(self, keys: Sequence[Key]) -> list[int]:
        """The blocks of the longest run of `keys`, from the first, that are keyed (used or cached); none retained."""
        out = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def key_of(self, block: int) -> Key | None:
        return self._key_of.get(block)

    def refs(self, block: int) -> int:
        return self._refs[block]

    # -- state --------------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self._used, self._shared, len(self._lru), len(self._free))

    @property
    def idle(self) -> bool:
        """No block is referenced (every allocate and retain was released)."""
        return self._used == 0

    def check(self) -> None:
        """Raise AssertionError unless the states partition the blocks and the counters match them (tests)."""
        free, cached = set(self._free), set(self._lru)
        used = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        assert len(free) == len(self._free), "a block is twice on the free list"
        assert not (free & cached) and not (free & used) and not (cached & used), "a block in two states"
        assert free | cached | used == set(range(self.num_blocks)), "a block in no state (leaked)"
        assert all(b not in self._key_of for b in free), "a free block keeps a key"
        assert all(b in self._key_of for b in cached), "a cached block has no key"
        assert {self._block_of[k]: k for k in self._block_of} == self._key_of, "keys and blocks disagree"
        assert self._used == len(used) and self._shared == sum(self._refs[b] > 1 for b in used)
