"""Tests for `mlx_trio.actors.cache_persistence`: background SSD writes, restores, faults and degrading."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.actors.cache_persistence import CachePersistenceActor, store_opener
from mlx_trio.actors.gpu_lease import GpuLease, open_gpu_lease
from mlx_trio.engine.prompt_cache.ssd_files import SUFFIX
from mlx_trio.engine.lease_thread import release_thread_streams, thread_default_stream
from mlx_trio.engine.model.load import LoadedModel, load_model
from mlx_trio.supervision.faults import FaultKind, Faults, InjectedFault
from mlx_trio.testing.tiny_models import LLAMA_SWA, tiny_model

PROMPT = [(13 * i + 5) % 250 + 3 for i in range(30)]
WAIT_S = 10.0  # only reached when a test fails


@pytest.fixture
async def lease() -> AsyncIterator[GpuLease]:
    async with open_gpu_lease(on_thread_start=thread_default_stream, on_thread_exit=release_thread_streams) as lease:
        yield lease


@pytest.fixture
async def model(lease: GpuLease) -> LoadedModel:
    # Sliding-window llama: RotatingKVCache and KVCache layers in one entry.
    return await lease.run(partial(load_model, str(tiny_model(LLAMA_SWA))))


def _prefill(model: LoadedModel, tokens: list[int]) -> list[Any]:
    """Lease thread: fresh caches holding `tokens`."""
    caches = make_prompt_cache(model.model)
    model.model(mx.array([tokens]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def _next_logits(model: LoadedModel, caches: list[Any], tokens: list[int]) -> list[float]:
    """Lease thread: the last-position logits after feeding `tokens`, as plain floats."""
    return model.model(mx.array([tokens]), cache=caches)[0, -1].tolist()


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


async def _wait_for(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(WAIT_S):
        while not predicate():
            await trio.sleep(0.005)


def _actor(lease: GpuLease, model: LoadedModel, directory: Path | None, *, faults: Faults | None = None,
           max_queue: int = 8, max_bytes: int = 2**30, io_timeout_s: float = 10.0) -> CachePersistenceActor:
    async def get_model() -> LoadedModel:
        return model

    opener = store_opener(lease, get_model, directory, max_bytes, 2048) if directory is not None else None
    return CachePersistenceActor(lease, opener, faults=faults, max_queue=max_queue, io_timeout_s=io_timeout_s)


async def _started(nursery: trio.Nursery, actor: CachePersistenceActor) -> CachePersistenceActor:
    await nursery.start(actor.run)
    await _wait_for(lambda: actor._store is not None or actor.statistics().degraded or not actor.statistics().enabled)
    return actor


async def test_an_offered_entry_is_written_and_restored_after_a_restart(
        lease: GpuLease, model: LoadedModel, tmp_path: Path) -> None:
    """Offer, drain, then a new actor on the same directory restores caches that continue exactly."""
    head, rest = PROMPT[:20], PROMPT[20:]
    async with trio.open_nursery() as nursery:
        actor = await _started(nursery, _actor(lease, model, tmp_path))
        assert actor.offer_nowait(await lease.run(_prefill, model, head), head)
        await actor.drain()
        stats = actor.statistics()
        assert (stats.ssd_writes, stats.entries, stats.queue_depth, stats.ssd_errors) == (1, 1, 0, 0)
        assert stats.bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        again = await _started(nursery, _actor(lease, model, tmp_path))
        assert again.statistics().entries == 1
        restored = await again.restore(PROMPT)
        assert restored is not None and restored[1] == len(head)
        got = await lease.run(_next_logits, model, restored[0], rest)
        want = await lease.run(_next_logits, model, await lease.run(_prefill, model, head), rest)
        assert got == want
        assert again.statistics().ssd_reads == 1
        assert await again.restore(PROMPT[1:]) is None  # no stored prefix
        assert await again.restore(PROMPT, max_len=len(head) - 1) is None
        nursery.cancel_scope.cancel()


async def test_a_full_queue_drops_offers_and_never_blocks(lease: GpuLease, model: LoadedModel, tmp_path: Path) -> None:
    """With the writer hung, max_queue offers wait and the next is refused at once, counted as dropped."""
    faults = Faults()
    faults.arm("cache-persistence", FaultKind.HANG)
    caches = [await lease.run(_prefill, model, PROMPT[:i]) for i in (5, 6, 7, 8)]
    async with trio.open_nursery() as nursery:
        actor = await _started(nursery, _actor(lease, model, tmp_path, faults=faults, max_queue=2))
        assert actor.offer_nowait(caches[0], PROMPT[:5])
        await _wait_for(lambda: len(faults.fired) == 1)  # the writer holds entry 0, hung
        assert actor.offer_nowait(caches[1], PROMPT[:6]) and actor.offer_nowait(caches[2], PROMPT[:7])
        assert not actor.offer_nowait(caches[3], PROMPT[:8])
        stats = actor.statistics()
        assert (stats.dropped, stats.queue_depth, stats.ssd_writes) == (1, 2, 0)
        with trio.move_on_after(0.05):
            await actor.drain()
            pytest.fail("drain returned while entries were still queued")
        nursery.cancel_scope.cancel()
    assert _files(tmp_path) == []


async def test_fail_write_fails_one_write_and_the_actor_keeps_writing(
        lease: GpuLease, model: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An injected write failure is counted in ssd_errors; it leaves no file and does not degrade."""
    faults = Faults()
    faults.arm("cache-persistence", FaultKind.FAIL_WRITE)
    async with trio.open_nursery() as nursery:
        actor = await _started(nursery, _actor(lease, model, tmp_path, faults=faults))
        assert actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:5]), PROMPT[:5])
        await actor.drain()
        assert _files(tmp_path) == []
        assert actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:6]), PROMPT[:6])
        await actor.drain()
        stats = actor.statistics()
        assert (stats.ssd_errors, stats.ssd_writes, stats.entries, stats.degraded) == (1, 1, 1, False)
        assert await actor.restore(PROMPT[:5]) is None and (await actor.restore(PROMPT))[1] == 6
        nursery.cancel_scope.cancel()
    assert [f.kind for f in faults.fired] == [FaultKind.FAIL_WRITE]


async def test_a_write_stalled_past_the_io_timeout_turns_the_tier_off_once(
        lease: GpuLease, model: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """stall-io blocks the write's worker thread (a hung disk): past io_timeout_s the actor gives up on it,
    drains, refuses offers and restores nothing, with one warning naming the directory."""
    faults = Faults()
    async with trio.open_nursery() as nursery:
        actor = await _started(nursery, _actor(lease, model, tmp_path, faults=faults, io_timeout_s=0.2))
        faults.arm("cache-persistence", FaultKind.STALL_IO)
        assert actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:5]), PROMPT[:5])
        await actor.drain()
        stats = actor.statistics()
        assert stats.degraded and stats.ssd_writes == 0 and stats.reason.startswith("disk stalled: a write in")
        assert not actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:6]), PROMPT[:6])
        assert await actor.restore(PROMPT) is None
        nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(tmp_path) in warnings[0] and "RAM only" in warnings[0]


async def test_a_crash_during_a_write_leaves_no_partial_file_and_a_restart_works(
        lease: GpuLease, model: LoadedModel, tmp_path: Path) -> None:
    """raise fires between materialising and writing: the actor dies, queued entries are let go, no file
    is visible; a new actor on the same directory writes and restores."""
    faults = Faults()
    faults.arm("cache-persistence", FaultKind.RAISE)
    actor = _actor(lease, model, tmp_path, faults=faults)
    with pytest.RaisesGroup(InjectedFault):
        async with trio.open_nursery() as nursery:
            await _started(nursery, actor)
            # Both prepared first: the actor may crash at any checkpoint after the first offer.
            five, six = await lease.run(_prefill, model, PROMPT[:5]), await lease.run(_prefill, model, PROMPT[:6])
            assert actor.offer_nowait(five, PROMPT[:5])
            assert actor.offer_nowait(six, PROMPT[:6])
            await trio.sleep_forever()
    with trio.fail_after(WAIT_S):
        await actor.drain()  # both entries were given up: nothing waits on a dead actor
    assert _files(tmp_path) == [] and actor.statistics().ssd_writes == 0
    async with trio.open_nursery() as nursery:
        again = await _started(nursery, _actor(lease, model, tmp_path, faults=faults))
        assert again.offer_nowait(await lease.run(_prefill, model, PROMPT[:7]), PROMPT[:7])
        await again.drain()
        assert [name.endswith(SUFFIX) for name in _files(tmp_path)] == [True]
        assert (await again.restore(PROMPT))[1] == 7
        nursery.cancel_scope.cancel()


async def test_an_unusable_directory_degrades_to_ram_only_with_one_warning(
        lease: GpuLease, model: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A path that cannot be a directory: one warning, every offer refused, restores miss, nothing raises."""
    (tmp_path / "file").write_text("x")
    async with trio.open_nursery() as nursery:
        actor = await _started(nursery, _actor(lease, model, tmp_path / "file" / "cache"))
        caches = await lease.run(_prefill, model, PROMPT[:5])
        assert not actor.offer_nowait(caches, PROMPT[:5]) and not actor.offer_nowait(caches, PROMPT[:5])
        assert await actor.restore(PROMPT) is None
        stats = actor.statistics()
        assert (stats.enabled, stats.degraded, stats.dropped, stats.entries) == (True, True, 0, 0)
        await actor.drain()
        nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RAM only" in warnings[0]


async def test_a_directory_removed_mid_run_degrades_once_and_crashes_nothing(
        lease: GpuLease, model: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first write after the directory vanished fails: one warning, writing stops, restores just miss."""
    directory = tmp_path / "cache"
    async with trio.open_nursery() as nursery:
        actor = await _started(nursery, _actor(lease, model, directory))
        assert actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:5]), PROMPT[:5])
        await actor.drain()
        for p in directory.iterdir():
            p.unlink()
        directory.rmdir()
        for n in (6, 7, 8):
            actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:n]), PROMPT[:n])
        await actor.drain()
        assert await actor.restore(PROMPT) is None
        assert not actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:9]), PROMPT[:9])
        stats = actor.statistics()
        assert (stats.degraded, stats.ssd_writes, stats.ssd_errors, stats.entries) == (True, 1, 1, 0)
        nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RAM only" in warnings[0]


async def test_a_corrupted_file_restores_as_a_miss_and_is_removed(
        lease: GpuLease, model: LoadedModel, tmp_path: Path) -> None:
    """Flipped bytes in a stored entry: restore returns None, the file is gone, the actor carries on."""
    async with trio.open_nursery() as nursery:
        actor = await _started(nursery, _actor(lease, model, tmp_path))
        assert actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:5]), PROMPT[:5])
        await actor.drain()
        (path,) = tmp_path.iterdir()
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0xFF
        path.write_bytes(bytes(raw))
        assert await actor.restore(PROMPT) is None
        assert _files(tmp_path) == [] and actor.statistics().entries == 0
        assert actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:6]), PROMPT[:6])
        await actor.drain()
        assert (await actor.restore(PROMPT))[1] == 6
        nursery.cancel_scope.cancel()


async def test_without_a_directory_the_actor_runs_disabled(lease: GpuLease, model: LoadedModel) -> None:
    """No --prompt-cache-dir: offers are refused (the caller keeps its caches), restores miss, drain returns."""
    async with trio.open_nursery() as nursery:
        actor = await _started(nursery, _actor(lease, model, None))
        assert not actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:5]), PROMPT[:5])
        assert await actor.restore(PROMPT) is None
        await actor.drain()
        stats = actor.statistics()
        assert (stats.enabled, stats.degraded, stats.dropped, stats.ssd_writes) == (False, False, 0, 0)
        nursery.cancel_scope.cancel()


async def test_a_restore_waits_for_a_queued_write_of_a_longer_prefix(
        lease: GpuLease, model: LoadedModel, tmp_path: Path) -> None:
    """A turn offered just before its follow-up asks: the restore waits for that write and serves it."""
    async with trio.open_nursery() as nursery:
        actor = await _started(nursery, _actor(lease, model, tmp_path))
        await actor.restore(PROMPT)  # the directory is scanned
        assert actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:20]), PROMPT[:20])
        assert actor.statistics().ssd_writes == 0  # queued, not written yet
        restored = await actor.restore(PROMPT, max_len=len(PROMPT) - 1, wait_s=WAIT_S)
        assert restored is not None and restored[1] == 20
        nursery.cancel_scope.cancel()


async def test_a_restore_waits_for_a_queued_write_at_most_its_bound(
        lease: GpuLease, model: LoadedModel, tmp_path: Path) -> None:
    """The writer hangs: the restore gives up on the write after `wait_s` and misses."""
    faults = Faults()
    faults.arm("cache-persistence", FaultKind.HANG)
    async with trio.open_nursery() as nursery:
        actor = await _started(nursery, _actor(lease, model, tmp_path, faults=faults))
        assert actor.offer_nowait(await lease.run(_prefill, model, PROMPT[:20]), PROMPT[:20])
        await _wait_for(lambda: len(faults.fired) == 1)
        with trio.fail_after(WAIT_S):
            assert await actor.restore(PROMPT, wait_s=0.05) is None
        nursery.cancel_scope.cancel()
