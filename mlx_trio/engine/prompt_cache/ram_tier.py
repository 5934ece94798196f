"""The RAM tier of the prompt cache: token-prefix lookup, LRU eviction by bytes (docs/design.md §6.2).

Entries map the token ids whose KV a set of per-layer caches holds to those
caches. A lookup finds the longest *usable* prefix of a prompt: an entry that
is a prefix of it, or a trimmable entry (full attention, a sliding window not
yet wrapped) sharing a common prefix with it, trimmed there. A lookup always
leaves at least the prompt's last token to compute: it is the input of the
step that samples token 0. Non-trimmable state (a wrapped ring, recurrent
`ArraysCache` layers) is only reused whole, at the token count it was stored
at: that is why prefill stores snapshots at message boundaries.

Lookups never consume: the caller clones the entry's caches (engine/kv/cache_clone.py),
so N requests sharing a system prompt reuse one prefill. Matching compares the
prompt with every entry's tokens as numpy arrays: linear in tokens and
vectorised (7.6 ms for 64 entries of 8.5k tokens on a 2-core VM). mlx-lm's
`PromptTrie` finds a longer entry by a depth-first walk that copies the path
at every step, quadratic in its length (45 ms for one 8.5k-token entry on the
same VM, more per such entry), on the Trio thread: a stall of every stream.
Plain Python and numpy, no MLX calls: the actors own the one instance and
call it between awaits; dropped caches are handed to `on_evict` (which frees
them on the lease thread).

Pending puts (docs/prompt-cache.md): a row that joins the decode batch is
recorded (`expect`) with its prompt until its finish-time put is made or
given up (`settle`). A lookup can then tell that a better entry is on its way
(`awaited_by`): an agent's next turn, sent the moment the last one's final
event arrived, extends that prompt, and its caller waits for the put instead
of missing.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np


@attrs.frozen
class CacheEntry:
    """Evaluated per-layer caches holding exactly the KV of `tokens`."""

    tokens: tuple[int, ...]
    caches: list[Any] = attrs.field(eq=False, repr=False)
    nbytes: int
    trimmable: bool
    # Whether the KV is stored quantized (`--kv-bits`): a quantized row can use such an entry only from
    # its conversion point on (`HitLimit`, engine/kv/kv_scheme.py).
    quantized: bool = False
    ids: np.ndarray = attrs.field(eq=False, repr=False, init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "ids", np.asarray(self.tokens, dtype=np.int64))

    def shared_prefix(self, ids: np.ndarray) -> int:
        """How many leading tokens this entry shares with `ids`."""
        n = min(len(self.ids), len(ids))
        differ = self.ids[:n] != ids[:n]
        # The first True, without `flatnonzero`'s index array: 2.3x faster over 2.7k-token entries, and every
        # lookup runs this once per entry on the Trio thread (docs/lab-notes/2026-12-01-h200-pass13.md, c=256).
        first = int(differ.argmax()) if n else 0
        return first if n and differ[first] else n

    def usable_for(self, ids: np.ndarray, shared: int | None = None) -> int:
        """Tokens of this entry a prompt continuing `ids` can start from: all when it is a prefix, else
        the shared prefix when it can be trimmed there, else none. `shared`: `shared_prefix(ids)`, if known."""
        shared = self.shared_prefix(ids) if shared is None else shared
        if shared == len(self.ids):
            return shared
        return shared if self.trimmable else 0


# What a lookup may use of an entry, given whether it is quantized, the tokens it holds and those it shares
# (less: trimmed there).
HitLimit = Callable[[bool, int, int], int]


@attrs.frozen
class CacheHit:
    """Use `entry`'s caches trimmed to their first `usable` tokens (`usable <= len(entry.tokens)`).

    `caches` is the entry's list as it was at the lookup: an eviction that
    frees the entry afterwards (clearing its list on the lease thread) leaves
    this hit's references, and so its arrays, intact until it is used.
    """

    entry: CacheEntry
    usable: int
    caches: list[Any] = attrs.field(eq=False, repr=False)

    @caches.default
    def _lookup_time_caches(self) -> list[Any]:
        return list(self.entry.caches)

    @property
    def trim(self) -> int:
        return len(self.entry.tokens) - self.usable


@attrs.frozen
class PromptCacheStatistics:
    """Zeros by default: what `/stats` shows when there is no prompt cache."""

    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    max_entries: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    puts: int = 0
    evictions: int = 0
    restore_failures: int = 0  # entries dropped because a row started from them failed (`discard`)


class PromptCache:
    """Entries keyed by token ids; longest-usable-prefix lookup; LRU eviction by bytes and count."""

    def __init__(self, *, max_bytes: int, max_entries: int,
                 on_evict: Callable[[CacheEntry], None] = lambda entry: None) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._on_evict = on_evict
        # Invariant: _lru holds every entry by its tokens, least recently used first,
        # and _nbytes is the sum of their nbytes.
        self._lru: collections.OrderedDict[tuple[int, ...], CacheEntry] = collections.OrderedDict()
        self._nbytes = 0
        # Puts on their way (see `expect`): a key (the request id) to the prompt its entry will start with.
        self._pending: dict[str, np.ndarray] = {}
        self._hits = self._misses = self._hit_tokens = self._puts = self._evictions = self._restore_failures = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._lru

    def shared_prefixes(self, prompt: Sequence[int]) -> list[tuple[int, CacheEntry]]:
        """Each entry (least recently used first) with how many of the tokens a lookup of `prompt` may use
        (all but its last) it shares: one pass that `lookup` and a divergence report can both read."""
        ids = np.asarray(prompt[:-1], dtype=np.int64)
        return [(entry.shared_prefix(ids), entry) for entry in self._lru.values()] if len(ids) else []

    def lookup(self, prompt: Sequence[int], *, shared: list[tuple[int, CacheEntry]] | None = None,
               limit: HitLimit | None = None) -> CacheHit | None:
        """The longest usable cached prefix of `prompt`, leaving its last token to compute; counts hit/miss.

        `shared`: `shared_prefixes(prompt)` taken since the cache last changed, so it is not computed twice.
        `limit`: cuts what each entry offers (a quantized KV scheme's exactness rule); an entry that cannot be
        trimmed to the cut offers nothing.
        """
        hit = self._best(list(prompt[:-1]), shared, limit)
        if hit is None:
            self._misses += 1
            return None
        self._hits += 1
        self._hit_tokens += hit.usable
        self._lru.move_to_end(hit.entry.tokens)
        return hit

    def _best(self, target: list[int], shared: list[tuple[int, CacheEntry]] | None = None,
              limit: HitLimit | None = None) -> CacheHit | None:
        if not target or not self._lru:
            return None
        ids = np.asarray(target, dtype=np.int64)
        best: CacheHit | None = None
        pairs = shared if shared is not None else [(None, entry) for entry in self._lru.values()]
        for known, entry in pairs:
            usable = entry.usable_for(ids, known)
            if usable and limit is not None:
                cut = limit(entry.quantized, len(entry.tokens), usable)
                usable = cut if cut == usable or entry.trimmable else 0
            if usable and (best is None or (usable, -len(entry.tokens)) > (best.usable, -len(best.entry.tokens))):
                best = CacheHit(entry, usable)
        return best

    def expect(self, key: str, prefix: Sequence[int]) -> None:
        """A put of an entry that starts with `prefix` may come under `key` (until `settle(key)`)."""
        self._pending[key] = np.asarray(prefix, dtype=np.int64)

    def settle(self, key: str) -> None:
        """The put expected under `key` was made or will never be; idempotent."""
        self._pending.pop(key, None)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def awaited_by(self, prompt: Sequence[int]) -> list[str]:
        """Keys of pending puts that would serve `prompt` better than what the cache holds now.

        A pending put counts when its whole prefix is a prefix of the tokens
        a lookup may use (all but the prompt's last) and longer than the best
        usable entry: the prompt continues that request's conversation. A
        sibling that shares only a system prompt never waits. Does not count
        as a lookup.
        """
        target = list(prompt[:-1])
        if not self._pending or not target:
            return []
        ids = np.asarray(target, dtype=np.int64)
        best = self._best(target)
        have = best.usable if best is not None else 0
        return [key for key, prefix in self._pending.items()
                if have < len(prefix) <= len(ids) and np.array_equal(ids[: len(prefix)], prefix)]

    def put(self, entry: CacheEntry) -> bool:
        """Insert (or refresh) `entry`, then evict LRU entries over the caps; False if it can never fit."""
        if not entry.tokens or entry.nbytes > self.max_bytes or self.max_entries <= 0:
            self._on_evict(entry)
            return False
        previous = self._lru.pop(entry.tokens, None)
        if previous is not None:
            self._nbytes -= previous.nbytes
            if previous is not entry:
                self._on_evict(previous)
        self._lru[entry.tokens] = entry
        self._nbytes += entry.nbytes
        self._puts += 1
        if entry.trimmable:
            # A trimmable entry serves every prefix of itself: shorter entries of its format only cost bytes.
            # (Of the other format they may serve what it cannot: a quantized row takes bf16 KV only up to its
            # conversion point and quantized KV only from there, `HitLimit`.)
            for shorter in [e for e in self._lru.values()
                            if len(e.tokens) < len(entry.tokens) and e.shared_prefix(entry.ids) == len(e.tokens)
                            and e.quantized == entry.quantized]:
                self._drop(shorter)
        self.trim_to(self.max_bytes)
        return entry.tokens in self._lru

    def trim_to(self, max_bytes: int) -> int:
        """Evict least recently used entries until at most `max_bytes` (and `max_entries`) remain; bytes freed."""
        freed = 0
        while self._lru and (self._nbytes > max_bytes or len(self._lru) > self.max_entries):
            entry = next(iter(self._lru.values()))
            freed += entry.nbytes
            self._drop(entry)
            self._evictions += 1
        return freed

    def discard(self, entry: CacheEntry) -> bool:
        """Drop `entry` because a row started from it failed (counted); False if it is no longer held."""
        if self._lru.get(entry.tokens) is not entry:
            return False
        self._drop(entry)
        self._restore_failures += 1
        return True

    def clear(self) -> None:
        self.trim_to(-1)

    def _drop(self, entry: CacheEntry) -> None:
        del self._lru[entry.tokens]
        self._nbytes -= entry.nbytes
        self._on_evict(entry)

    def statistics(self) -> PromptCacheStatistics:
        return PromptCacheStatistics(
            entries=len(self._lru), bytes=self._nbytes, max_bytes=self.max_bytes, max_entries=self.max_entries,
            hits=self._hits, misses=self._misses, hit_tokens=self._hit_tokens, puts=self._puts,
            evictions=self._evictions, restore_failures=self._restore_failures,
        )
