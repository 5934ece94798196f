"""`PromptCaching`, the prompt cache as the actors use it: SSD hand-off, restores, room for live rows, frees.

The RAM tier's own bookkeeping (prefix matching, LRU, caps) is tested in
tests/engine/prompt_cache/test_ram_tier.py, and the whole path through the
engine in test_prompt_cache_lane.py and test_prompt_cache_ssd_lane.py; here,
what this layer adds: the order of the SSD offer and the RAM put, restores
cloned on the lease, the ceiling that live rows leave, and evicted entries
freed on the lease thread, never in the caller.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx
import pytest
import trio
import trio.testing
from mlx_lm.models.cache import KVCache

from mlx_trio.actors.gpu_lease import GpuLease, open_gpu_lease
from mlx_trio.actors.prompt_caching import PENDING_PUT_WAIT_S, PromptCaching
from mlx_trio.engine.lease_thread import release_thread_streams, thread_default_stream
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry


class FakeLease:
    """Holds the frees it is handed until `run_frees`, as the real lease's FIFO holds them behind earlier jobs.

    `eager`: runs each free at once instead, as an idle lease thread may before the caller's next line.
    """

    def __init__(self, *, eager: bool = False) -> None:
        self.eager = eager
        self.frees: list[Callable[[], object]] = []

    def free_nowait(self, close: Callable[[], object]) -> None:
        self.frees.append(close)
        if self.eager:
            self.run_frees()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise AssertionError("a RAM-only path must not run lease jobs")

    def run_frees(self) -> None:
        frees, self.frees = self.frees, []
        for close in frees:
            close()


@attrs.define
class FakePersistence:
    """The SSD tier's two calls: offers are recorded (and taken unless `full`); restores answer `stored` once."""

    stored: tuple[list[Any], int] | None = None
    full: bool = False
    offers: list[tuple[list[Any], tuple[int, ...]]] = attrs.Factory(list)
    restores: list[tuple[tuple[int, ...], int | None]] = attrs.Factory(list)

    def offer_nowait(self, caches: Sequence[Any], tokens: Sequence[int]) -> bool:
        self.offers.append((list(caches), tuple(tokens)))
        return not self.full

    async def restore(self, tokens: Sequence[int], *, max_len: int | None = None,
                      wait_s: float = 0.0) -> tuple[list[Any], int] | None:
        self.restores.append((tuple(tokens), max_len))
        stored, self.stored = self.stored, None
        return stored


def _entry(tokens: Sequence[int], nbytes: int = 10) -> CacheEntry:
    return CacheEntry(tuple(tokens), [object(), object()], nbytes, trimmable=True)


class _Admission:
    """Admission as the prompt cache sees it: the bytes live rows leave unreserved."""

    def __init__(self, room: Callable[[], int]) -> None:
        self._room = room

    def unreserved_bytes(self) -> int:
        return self._room()


class _Lane:
    """The parts of `Lane` the prompt cache reads: the current lease, SSD tier and admission."""

    def __init__(self, lease: Any, persistence: Any, room: Callable[[], int | None]) -> None:
        self.lease, self.persistence, self._room = lease, persistence, room

    @property
    def admission(self) -> _Admission | None:
        # No admission yet (room None): the cache keeps only its own ceiling.
        return None if self._room() is None else _Admission(lambda: self._room() or 0)


def _caching(lease: Any = None, persistence: Any = None, room: Callable[[], int | None] = lambda: None,
             max_bytes: int = 100, max_entries: int = 10) -> PromptCaching:
    return PromptCaching(_Lane(lease, persistence, room), max_bytes=max_bytes,  # type: ignore[arg-type]
                         max_entries=max_entries)


# -- RAM only ---------------------------------------------------------------------------------------

async def test_a_stored_entry_serves_prompts_that_continue_it_without_asking_the_ssd_tier() -> None:
    persistence = FakePersistence()
    caching = _caching(FakeLease(), persistence)
    entry = _entry([1, 2, 3, 4])
    caching.store(entry)
    assert caching.has([1, 2, 3, 4]) and not caching.has([1, 2, 3]) and caching.nbytes == 10
    hit = await caching.lookup([1, 2, 3, 4, 5, 6])
    assert hit is not None and hit.entry is entry and hit.usable == 4 and hit.caches == entry.caches
    assert persistence.restores == []
    stats = caching.statistics()
    assert (stats.entries, stats.bytes, stats.puts, stats.hits, stats.misses, stats.hit_tokens) == (1, 10, 1, 1, 0, 4)


async def test_a_ram_miss_is_none_without_an_ssd_tier_or_before_the_lease_exists() -> None:
    assert await _caching(FakeLease(), persistence=None).lookup([7, 8, 9]) is None
    persistence = FakePersistence(stored=([object()], 2))
    assert await _caching(lease=None, persistence=persistence).lookup([7, 8, 9]) is None
    assert persistence.restores == []  # no lease to rebuild on: the SSD tier is not asked


async def test_an_evicted_entry_is_freed_on_the_lease_not_in_the_caller() -> None:
    lease = FakeLease()
    caching = _caching(lease, max_bytes=25)
    old, new = _entry([1, 2], nbytes=10), _entry([3, 4], nbytes=20)
    caching.store(old)
    held = await caching.lookup([1, 2, 9])  # a hit taken before the eviction: a prefill about to clone it
    caching.store(new)  # 30 bytes > 25: the least recently used entry goes
    assert not caching.has([1, 2]) and caching.has([3, 4]) and caching.nbytes == 20
    assert len(old.caches) == 2 and len(lease.frees) == 1  # queued, not yet run
    lease.run_frees()
    assert old.caches == [] and len(new.caches) == 2
    assert held is not None and len(held.caches) == 2  # the hit keeps its own references


async def test_without_a_lease_an_eviction_frees_nothing() -> None:
    caching = _caching(lease=None, max_bytes=15)
    old = _entry([1, 2])
    caching.store(old)
    caching.store(_entry([3, 4]))
    assert not caching.has([1, 2]) and len(old.caches) == 2


# -- room for live rows ---------------------------------------------------------------------------------

async def test_stores_keep_within_the_room_live_rows_leave() -> None:
    room: list[int | None] = [25]
    lease = FakeLease()
    caching = _caching(lease, room=lambda: room[0], max_bytes=100)
    for i in range(3):
        caching.store(_entry([i, i], nbytes=10))
    assert caching.nbytes == 20 and not caching.has([0, 0]) and caching.has([2, 2])
    room[0] = 5  # rows took the bytes: the next store gives way, its own entry first if it must
    caching.store(_entry([3, 3], nbytes=10))
    assert caching.nbytes == 0 and caching.statistics().entries == 0
    room[0] = None  # no shared ceiling: only the cache's own cap
    for i in range(12):
        caching.store(_entry([10 + i], nbytes=10))
    assert caching.nbytes == 100
    assert len(lease.frees) == caching.statistics().evictions == 1 + 3 + 2  # every eviction freed once


async def test_make_room_evicts_down_to_the_bytes_admission_asks_and_reports_them() -> None:
    lease = FakeLease()
    caching = _caching(lease, max_bytes=100)
    for i in range(4):
        caching.store(_entry([i], nbytes=10 + i))  # 10, 11, 12, 13 bytes, oldest first
    assert caching.make_room(30) == 10 + 11
    assert caching.nbytes == 25 and caching.has([2]) and caching.has([3])
    assert caching.make_room(100) == 0 and len(lease.frees) == 2


# -- the SSD tier -------------------------------------------------------------------------------------

async def test_store_offers_the_entry_to_the_ssd_tier_before_ram_may_drop_it() -> None:
    lease, persistence = FakeLease(eager=True), FakePersistence()
    caching = _caching(lease, persistence, max_bytes=50)
    small, big = _entry([1, 2, 3], nbytes=10), _entry([4, 5, 6], nbytes=60)
    big_caches = list(big.caches)
    caching.store(small)
    caching.store(big)  # too big for RAM: dropped, and freed at once
    assert not caching.has([4, 5, 6]) and big.caches == []
    assert persistence.offers == [(small.caches, (1, 2, 3)), (big_caches, (4, 5, 6))]  # offered before the free
    assert caching.has([1, 2, 3]) and caching.nbytes == 10


async def test_a_full_ssd_queue_still_leaves_the_entry_in_ram() -> None:
    persistence = FakePersistence(full=True)
    caching = _caching(FakeLease(), persistence)
    caching.store(_entry([1, 2, 3]))
    assert len(persistence.offers) == 1 and caching.has([1, 2, 3])


@pytest.fixture
async def lease() -> AsyncIterator[GpuLease]:
    async with open_gpu_lease(on_thread_start=thread_default_stream, on_thread_exit=release_thread_streams) as lease:
        yield lease


def _kv_caches(tokens: int, layers: int = 2) -> list[Any]:
    """Lease thread: per-layer mlx-lm caches holding `tokens` positions of zeros (as a restore rebuilds them)."""
    caches = []
    for _ in range(layers):
        cache = KVCache()
        cache.update_and_fetch(mx.zeros((1, 2, tokens, 8)), mx.zeros((1, 2, tokens, 8)))
        caches.append(cache)
    return caches


def _nbytes(caches: list[Any]) -> int:
    return sum(c.nbytes for c in caches)


async def test_a_ram_miss_is_restored_from_the_ssd_tier_into_ram_through_the_lease(lease: GpuLease) -> None:
    prompt = list(range(3, 13))
    restored = await lease.run(_kv_caches, 6)
    persistence = FakePersistence(stored=(restored, 6))
    caching = _caching(lease, persistence, max_bytes=10**6)
    hit = await caching.lookup(prompt)
    # At most all but the prompt's last token: that one is left to compute.
    assert persistence.restores == [(tuple(prompt), len(prompt) - 1)]
    assert hit is not None and hit.usable == 6 and hit.entry.tokens == tuple(prompt[:6])
    assert hit.entry.caches == restored and hit.entry.trimmable
    assert caching.nbytes == hit.entry.nbytes == await lease.run(_nbytes, restored) > 0
    again = await caching.lookup(prompt)  # now a RAM hit: the SSD tier is not asked twice
    assert again is not None and again.entry is hit.entry and len(persistence.restores) == 1
    stats = caching.statistics()
    assert (stats.misses, stats.hits, stats.puts) == (1, 2, 1)


async def test_an_ssd_miss_is_none(lease: GpuLease) -> None:
    persistence = FakePersistence(stored=None)
    assert await _caching(lease, persistence).lookup([1, 2, 3]) is None
    assert persistence.restores == [((1, 2, 3), 2)]


async def test_a_restore_too_big_for_ram_is_no_hit_and_is_freed(lease: GpuLease) -> None:
    restored = await lease.run(_kv_caches, 6)
    caching = _caching(lease, FakePersistence(stored=(restored, 6)), max_bytes=10)
    assert await caching.lookup(list(range(3, 13))) is None
    assert caching.nbytes == 0
    await lease.run(lambda: None)  # the free was queued before this job (FIFO)
    assert restored == []


async def test_a_restored_hit_outlives_the_room_that_evicts_it(lease: GpuLease) -> None:
    """Live rows leave no room: the restored entry goes at once, but the lookup's hit still holds its caches."""
    restored = await lease.run(_kv_caches, 6)
    caching = _caching(lease, FakePersistence(stored=(restored, 6)), room=lambda: 0, max_bytes=10**6)
    hit = await caching.lookup(list(range(3, 13)))
    await lease.run(lambda: None)
    assert caching.nbytes == 0 and restored == []  # evicted and freed
    assert hit is not None and hit.usable == 6 and len(hit.caches) == 2
    assert await lease.run(_nbytes, hit.caches) > 0


# -- pending puts (a finished turn's put, awaited by its follow-up) ----------------------------------

async def test_a_follow_up_waits_for_the_pending_put_of_the_turn_it_continues() -> None:
    caching = _caching(FakeLease(), FakePersistence(), max_bytes=10**6)
    caching.store(_entry([1, 2, 3]))  # the snapshot at the last message boundary
    caching.expect_put("turn-1", [1, 2, 3, 4, 5])  # the turn's row joined the batch
    got: list[Any] = []

    async def follow_up() -> None:
        got.append(await caching.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow_up)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # waiting for the put, not served the shorter snapshot
        caching.store(_entry([1, 2, 3, 4, 5, 6, 7]))  # the finish-time put: prompt + completion
        caching.settle_put("turn-1")
    assert got[0] is not None and got[0].usable == 7
    assert caching.put_waits == 1 and caching.cache.pending == 0


async def test_only_a_prompt_that_extends_the_pending_prompt_waits() -> None:
    """A sibling sharing the system prompt, a repeat of the same prompt, a prompt the cache already
    serves as well: none waits (no checkpoint, nothing awaited)."""
    caching = _caching(FakeLease(), FakePersistence(), max_bytes=10**6)
    caching.store(_entry([1, 2, 3, 4, 5, 6]))
    caching.expect_put("a", [1, 2, 9, 9])
    caching.expect_put("b", [1, 2, 3, 4])
    assert caching.cache.awaited_by([1, 2, 9, 8, 8]) == []  # a sibling of "a"
    assert caching.cache.awaited_by([1, 2, 9, 9]) == []  # a's own prompt again (its last token is computed)
    assert caching.cache.awaited_by([1, 2, 3, 4, 5, 6, 7]) == []  # the cache serves more than b's prompt
    assert caching.cache.awaited_by([1, 2, 9, 9, 5, 6]) == ["a"]
    caching.settle_put("a")
    caching.settle_put("a")  # idempotent
    assert caching.cache.awaited_by([1, 2, 9, 9, 5, 6]) == []


async def test_a_pending_put_that_never_comes_delays_a_lookup_at_most_its_bound(autojump_clock: Any) -> None:
    caching = _caching(FakeLease(), FakePersistence(), max_bytes=10**6)
    caching.expect_put("stuck", [1, 2, 3])
    start = trio.current_time()
    assert await caching.lookup([1, 2, 3, 4, 5]) is None
    assert trio.current_time() - start == pytest.approx(PENDING_PUT_WAIT_S)  # the mock clock's time
