"""The prompt cache as the actors use it: RAM-tier lookups and puts, with the SSD tier behind them.

One instance per engine, created when the model is loaded and kept across
actor restarts (its entries are evaluated arrays that no restart corrupts).
The prefill actor looks prompts up and stores boundary snapshots; the
decode-step actor stores finished rows; admission trims it when live rows
need its bytes. Every call is synchronous between awaits (so no two actors
interleave inside one), except `lookup`, which may wait on an SSD restore.
Dropped entries are freed on the lease thread, which owns their arrays.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from mlx_trio.engine.kv import cache_clone
from mlx_trio.engine.prompt_cache.divergence import Divergences
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry, CacheHit, PromptCache, PromptCacheStatistics

if TYPE_CHECKING:
    from mlx_trio.actors.lane import Lane

log = logging.getLogger("mlx_trio.prompt_cache")


class PromptCaching:
    """Lookups, puts and trims of the engine's prompt cache; the SSD tier, when present, behind them.

    Uses the lane's current lease and cache-persistence actor (each may be
    restarted under it), and admission's unreserved bytes as its ceiling.
    """

    def __init__(self, lane: Lane, *, max_bytes: int, max_entries: int) -> None:
        self._lane = lane
        self.cache = PromptCache(max_bytes=max_bytes, max_entries=max_entries, on_evict=self._free)
        # Where recent prompts left their closest entry: "why did my cache miss?" (engine/prompt_cache/divergence.py).
        self.divergences = Divergences()

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def statistics(self) -> PromptCacheStatistics:
        return self.cache.statistics()

    async def lookup(self, prompt: Sequence[int]) -> CacheHit | None:
        """The longest usable cached prefix of `prompt`; on a RAM miss, what the SSD tier can restore."""
        self.divergences.note(self.cache.entries(), prompt)
        hit = self.cache.lookup(prompt)
        if hit is not None:
            return hit
        persistence, lease = self._lane.persistence, self._lane.lease
        if persistence is None or lease is None:
            return None
        # At most all but the last token: a lookup must leave that one to compute.
        restored = await persistence.restore(prompt, max_len=len(prompt) - 1)
        if restored is None:
            return None
        caches, length = restored
        entry = await lease.run(cache_clone.entry, tuple(prompt[:length]), caches)
        if not self.cache.put(entry):
            return None
        hit = self.cache.lookup(prompt)
        self._fit()  # after the lookup: the hit holds its entry even if the ceiling evicts it
        return hit

    def has(self, tokens: Sequence[int]) -> bool:
        return tokens in self.cache

    def store(self, entry: CacheEntry) -> None:
        """Put `entry` in RAM and queue it for the SSD tier (a full write queue drops it, never blocks)."""
        # Offer first: a put may evict (and free) the entry at once when it is too big for RAM.
        persistence = self._lane.persistence
        if persistence is not None:
            # Entries are never written again, so the writer may read them while RAM serves them.
            persistence.offer_nowait(list(entry.caches), entry.tokens)
        self.cache.put(entry)
        self._fit()

    def _fit(self) -> None:
        """Give way to live rows: hold no more than the shared KV ceiling leaves free."""
        admission = self._lane.admission
        if admission is not None:
            self.cache.trim_to(admission.unreserved_bytes())

    def make_room(self, max_bytes: int) -> int:
        """Evict until the cache holds at most `max_bytes`; returns the bytes freed."""
        return self.cache.trim_to(max_bytes)

    def _free(self, entry: CacheEntry) -> None:
        lease = self._lane.lease
        if lease is not None:
            # Queued after every job that may still clone the entry (the lease is FIFO).
            lease.free_nowait(partial(entry.caches.clear))
