"""The prompt cache as the actors use it: RAM-tier lookups and puts, with the SSD tier behind them.

One instance per engine, created when the model is loaded and kept across
actor restarts (its entries are evaluated arrays that no restart corrupts).
The prefill actor looks prompts up and stores boundary snapshots; the
decode-step actor stores finished rows; admission trims it when live rows
need its bytes. Every call is synchronous between awaits (so no two actors
interleave inside one), except `lookup`, which may wait on an SSD restore
or on a pending put. Dropped entries are freed on the lease thread, which
owns their arrays.

Pending puts close the race of an agent loop (docs/prompt-cache.md): a row
is expected (`expect_put`) from the moment it joins the decode batch, and
settled (`settle_put`, by `Lane.end_request`) after its finish-time put, so
a follow-up turn sent as soon as the final event arrived finds the put on
its way and waits for it (at most `PENDING_PUT_WAIT_S`) instead of missing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import attrs
import trio

from mlx_trio.engine.kv import cache_clone
from mlx_trio.engine.prompt_cache.divergence import Divergences
from mlx_trio.engine.prompt_cache.namespace import in_namespace
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry, CacheHit, HitLimit, PromptCache, PromptCacheStatistics

if TYPE_CHECKING:
    from mlx_trio.actors.lane import Lane

log = logging.getLogger("mlx_trio.prompt_cache")

# How long a lookup waits for pending puts that would serve it: a finished row's put comes one
# decode step after its final event, so this bound only matters when something went wrong.
PENDING_PUT_WAIT_S = 1.0


class PromptCaching:
    """Lookups, puts and trims of the engine's prompt cache; the SSD tier, when present, behind them.

    Uses the lane's current lease and cache-persistence actor (each may be
    restarted under it), and admission's unreserved bytes as its ceiling.
    """

    def __init__(self, lane: Lane, *, max_bytes: int, max_entries: int) -> None:
        self._lane = lane
        self.cache = PromptCache(max_bytes=max_bytes, max_entries=max_entries, on_evict=self._free)
        # Set when the pending put of that key (a request id) is settled.
        self._settled: dict[str, trio.Event] = {}
        self.put_waits = 0  # lookups that waited for a pending put
        # Where recent prompts left their closest entry: "why did my cache miss?" (engine/prompt_cache/divergence.py).
        self.divergences = Divergences()

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def statistics(self) -> PromptCacheStatistics:
        return self.cache.statistics()

    def expect_put(self, key: str, prefix: Sequence[int]) -> None:
        """A finish-time put of an entry starting with `prefix` may come under `key` until `settle_put(key)`."""
        self.cache.expect(key, prefix)
        self._settled.setdefault(key, trio.Event())

    def settle_put(self, key: str) -> None:
        """The put expected under `key` was made or never will be (idempotent): wake its waiters."""
        self.cache.settle(key)
        event = self._settled.pop(key, None)
        if event is not None:
            event.set()

    async def lookup(self, prompt: Sequence[int], *, text: bool = True,
                     limit: HitLimit | None = None) -> CacheHit | None:
        """The longest usable cached prefix of `prompt`; on a RAM miss, what the SSD tier can restore.

        Waits first (at most `PENDING_PUT_WAIT_S` in all) for pending puts
        that would serve it better than the cache does now, then for queued
        SSD writes that would. `text` False (namespaced keys, `AdapterCaching`):
        no divergence report, since those tokens are not the tokenizer's. `limit`: `PromptCache.lookup`'s.
        """
        deadline = trio.current_time() + PENDING_PUT_WAIT_S
        awaited = self.cache.awaited_by(prompt)
        if awaited:
            self.put_waits += 1
            with trio.move_on_at(deadline):
                for key in awaited:
                    event = self._settled.get(key)
                    if event is not None:
                        await event.wait()
        # After the wait: a follow-up turn that waited for its previous turn's put is no miss.
        shared = self.cache.shared_prefixes(prompt)  # one pass over the entries for both
        if text:
            self.divergences.note((), prompt, shared=shared)
        hit = self.cache.lookup(prompt, shared=shared, limit=limit)
        if hit is not None:
            return hit
        persistence, lease = self._lane.persistence, self._lane.lease
        if persistence is None or lease is None:
            return None
        # At most all but the last token: a lookup must leave that one to compute.
        restored = await persistence.restore(prompt, max_len=len(prompt) - 1,
                                             wait_s=max(deadline - trio.current_time(), 0.0))
        if restored is None:
            return None
        caches, length = restored
        entry = await lease.run(cache_clone.entry, tuple(prompt[:length]), caches)
        if not self.cache.put(entry):
            return None
        hit = self.cache.lookup(prompt, limit=limit)
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

    def discard(self, hit: CacheHit, exc: BaseException) -> None:
        """A row started from `hit` failed with `exc`: drop its entry, so the request's resume (and every
        later request sharing the prefix) runs without it rather than failing on it again."""
        if self.cache.discard(hit.entry):
            log.warning("prompt cache entry of %d tokens dropped: a row started from it failed (%r)",
                        len(hit.entry.tokens), exc)

    def make_room(self, max_bytes: int) -> int:
        """Evict until the cache holds at most `max_bytes`; returns the bytes freed."""
        return self.cache.trim_to(max_bytes)

    def _free(self, entry: CacheEntry) -> None:
        lease = self._lane.lease
        if lease is not None:
            # Queued after every job that may still clone the entry (the lease is FIFO).
            lease.free_nowait(partial(entry.caches.clear))


class AdapterCaching:
    """The prompt cache as the requests of one adapter revision see it: the same calls, keys in its namespace.

    Every token sequence (prompts, entries, expected puts) is moved into the
    adapter's namespace (engine/prompt_cache/namespace.py), so its entries
    serve only its own requests and never the base model's or another
    adapter's. They share the RAM tier's bytes and LRU with every other
    entry, and the SSD tier (files of wide keys hold 64-bit ids); the
    namespace comes from the adapter's files' hash, so an SSD entry serves
    the same adapter revision after a restart and never another.
    """

    def __init__(self, caching: PromptCaching, namespace: int) -> None:
        self._caching = caching
        self._namespace = namespace

    def _key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return in_namespace(tokens, self._namespace)

    async def lookup(self, prompt: Sequence[int], *, limit: HitLimit | None = None) -> CacheHit | None:
        return await self._caching.lookup(self._key(prompt), text=False, limit=limit)

    def has(self, tokens: Sequence[int]) -> bool:
        return self._caching.has(self._key(tokens))

    def store(self, entry: CacheEntry) -> None:
        self._caching.store(attrs.evolve(entry, tokens=self._key(entry.tokens)))

    def expect_put(self, key: str, prefix: Sequence[int]) -> None:
        self._caching.expect_put(key, self._key(prefix))
