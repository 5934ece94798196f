"""The cache-persistence actor: the prompt cache's SSD tier, written in the background.

The RAM tier hands it entries it evicts or finishes with (`offer_nowait`) and
asks it for a stored prefix on a miss (`restore`). Writing never holds a
request back: the queue is bounded and a full queue drops the entry (it is
only a cache); the lease is held only to copy the arrays to the host
(`engine.host_cache.to_host`), and the file is written on a worker thread
(`engine/prompt_cache/ssd_files.py`). The first disk error (full, read-only,
directory removed) stops writing for good, with one warning: the prompt
cache goes on in RAM only. Bad files are read as misses, never raised; an
entry that passes its checksum but does not fit the model's caches (another
head_dim, layer count or dtype) is removed and counted (`restore_failures`),
and its request runs uncached.

Every file operation runs on a worker thread with a deadline
(`io_timeout_s`, `--prompt-cache-io-timeout`): one that overruns it (a hung
or very slow disk) is abandoned to its thread and disables the tier for
good, reads included, with one warning naming the directory; requests go on
with the RAM tier only, and `/stats` and `/health` say why.

Under --kv-layout paged the subclass in actors/block_persistence.py stores the block
pool's keyed blocks instead of entries.

Faults (`supervision/faults.py`, id "cache-persistence"): `raise`, `hang`
and `fail-write` fire after an entry is materialised and before its file is
written: `raise` crashes the actor (queued entries are lost, no partial
file is ever visible), `hang` blocks it (offers then fill the queue and are
dropped), `fail-write` fails that one write (counted in `ssd_errors`; the
actor keeps writing). `stall-io` blocks the worker thread of the next file
operation (a hung disk) until the deadline has disabled the tier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.actors.messages import drain_nowait
from mlx_trio.engine.prompt_cache.ssd_files import CacheFileStore, StoredEntryInfo
from mlx_trio.engine.prompt_cache.identity import identity_of_directory
from mlx_trio.engine.prompt_cache.host_cache import CacheShapes, cache_shapes, from_host, to_host
from mlx_trio.engine.prompt_cache.host_entry import HostEntry
from mlx_trio.engine.model.load import LoadedModel
from mlx_trio.errors import LeaseClosed
from mlx_trio.supervision.faults import FaultKind, Faults, InjectedFault

log = logging.getLogger("mlx_trio.cache_persistence")

ACTOR_ID = "cache-persistence"
# Entries waiting for the disk. Each holds a full KV cache in device memory
# until it is copied out, so the queue is short: past it, entries are dropped.
DEFAULT_MAX_QUEUE = 8
# Longest a file operation may take before the disk counts as hung (--prompt-cache-io-timeout):
# reading a GiB-sized entry from a working SSD takes about a second.
DEFAULT_IO_TIMEOUT_S = 10.0
# How many stored prefixes `restore` tries when the longest ones turn out unusable.
_RESTORE_ATTEMPTS = 3

# Makes this server's store, and the shapes of its model's caches (what a restored entry must fit).
OpenStore = Callable[[], Awaitable[tuple[CacheFileStore, CacheShapes]]]
T = TypeVar("T")


@attrs.frozen
class PersistenceStatistics:
    enabled: bool = False  # a directory was configured
    degraded: bool = False  # writing stopped after a disk error, or the directory could not be opened: RAM only
    entries: int = 0  # entry files indexed
    bytes: int = 0  # their total size
    ssd_reads: int = 0  # restores served from disk
    ssd_writes: int = 0  # entry files written
    ssd_errors: int = 0  # failed writes
    restore_failures: int = 0  # stored entries that passed their checksum but could not be rebuilt (removed)
    dropped: int = 0  # offers refused because the queue was full
    queue_depth: int = 0  # entries waiting to be written
    mailbox_depth: int = 0  # the same number, under the name the supervision tree reads
    reason: str = ""  # why it is degraded ("" when it is not)


@attrs.define(eq=False)
class _PendingWrite:
    """An offered entry. `caches` belong to the lease thread and are dropped there."""

    caches: list[Any] | None
    tokens: tuple[int, ...]
    written: trio.Event = attrs.field(factory=trio.Event)  # set once written or given up

    def release(self) -> None:
        self.caches = None  # run on the lease thread (free_nowait), so the arrays die there


def _materialise(pending: _PendingWrite) -> HostEntry:
    """Lease thread: copy the caches out and drop our reference to them here, on their thread."""
    caches, pending.caches = pending.caches, None
    assert caches is not None
    return to_host(caches, pending.tokens)


def _write(store: CacheFileStore, entry: HostEntry, fail: bool) -> StoredEntryInfo | None:
    """Worker thread: write one entry file (or fail it, when a fail-write fault is armed)."""
    if fail:
        raise InjectedFault(f"fail-write injected into {ACTOR_ID}")
    return store.write(entry)


def _file_job(fn: Callable[..., T], args: tuple[Any, ...], stalled_until: threading.Event | None) -> T:
    """Worker thread: `fn(*args)`, after blocking until `stalled_until` is set when a stall-io fault fired."""
    if stalled_until is not None:
        stalled_until.wait()
    return fn(*args)


class _Stalled(Exception):
    """A file operation overran `io_timeout_s`; the tier is disabled (see `_stall`)."""


class CachePersistenceActor:
    """Writes offered prompt-cache entries to disk in the background, and restores them on request.

    Args:
      lease: runs `to_host` / `from_host`, the only MLX work here.
      open_store: makes this server's `CacheFileStore` (see `store_opener`);
        None means no `--prompt-cache-dir`: the actor runs, refuses every
        offer and restores nothing.
      max_queue: entries that may wait for the disk before offers are dropped.
      io_timeout_s: longest one file operation may take before the tier is disabled.
    """

    def __init__(self, lease: GpuLease, open_store: OpenStore | None, *, faults: Faults | None = None,
                 max_queue: int = DEFAULT_MAX_QUEUE, io_timeout_s: float = DEFAULT_IO_TIMEOUT_S) -> None:
        self._lease = lease
        self._open_store = open_store
        self._faults = faults or Faults()
        self._io_timeout_s = io_timeout_s
        self.inbox_send, self._inbox = trio.open_memory_channel[_PendingWrite](max_queue)
        # Set once scanned; reads keep it after a write error, a stalled disk drops it (no reads either).
        self._store: CacheFileStore | None = None
        self._shapes: CacheShapes | None = None  # the model's, set with the store
        self._degraded = False
        self._reason = ""
        # Releases the worker thread a stall-io fault blocked, once the actor gave up on it.
        self._unstall = threading.Event()
        self._reads = self._writes = self._errors = self._dropped = self._restore_failures = 0
        # Invariant: _unfinished counts offered entries not yet written or released; _idle is set iff it is 0.
        self._unfinished = 0
        # Offered and not finished yet, in offer order: a restore waits for those that would serve it.
        self._queued: list[_PendingWrite] = []
        self._idle = trio.Event()
        self._opened = trio.Event()  # set once the directory was scanned (or found unusable)
        self._idle.set()

    def offer_nowait(self, caches: Sequence[Any], tokens: Sequence[int]) -> bool:
        """Queue `caches` (holding exactly `tokens`) for writing; never blocks.

        True: the actor now owns `caches`; the caller must not use or change
        them again. False (no directory, writing stopped, or the queue is full,
        which counts as `dropped`): nothing was taken, the caller keeps them.
        """
        if self._open_store is None or self._degraded:
            return False
        return self._enqueue(_PendingWrite(list(caches), tuple(tokens)))

    def _enqueue(self, pending: Any) -> bool:
        """Queue `pending` (whose `caches`, if any, are then ours); False, counted as `dropped`, if the queue is
        full."""
        try:
            self.inbox_send.send_nowait(pending)
        except trio.WouldBlock:
            self._dropped += 1
            return False
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        if self._unfinished == 0:
            self._idle = trio.Event()
        self._unfinished += 1
        self._queued.append(pending)
        return True

    async def _restore_job(self, store: CacheFileStore, info: StoredEntryInfo, what: str, fn: Callable[..., T],
                           *args: Any) -> T | None:
        """`fn(*args)`, bringing the stored file `info` back, as a lease job; None if it failed. A failure is
        counted, logged naming `what`, and removes the file: it passed its checksum, so it would fail the same
        way every time.

        Raises:
          LeaseClosed: the lease stopped.
        """
        try:
            return await self._lease.run(fn, *args)
        except LeaseClosed:
            raise
        except Exception as exc:
            self._restore_failures += 1
            log.warning("prompt cache %s %s could not be restored (%s): removed", what, info.key, exc)
            await self._io("remove", store.remove, info.key)
            return None

    async def restore(self, tokens: Sequence[int], *, max_len: int | None = None,
                      wait_s: float = 0.0) -> tuple[list[Any], int] | None:
        """Caches rebuilt from the longest stored prefix of `tokens` (at most `max_len` long), and its length.

        Waits for the directory's scan, and up to `wait_s` for queued writes
        of longer prefixes (a finished turn offered just before its follow-up
        asks). None on a miss, or when the stored
        files are unusable (they are removed): a bad file never raises here.
        The caller owns the returned caches (arrays of the lease thread).

        Raises:
          LeaseClosed: the lease stopped while rebuilding.
        """
        if self._open_store is not None:
            # A request that arrives while the directory is scanned waits for the scan (a
            # restarted server's first requests are the ones the SSD tier is for).
            await self._opened.wait()
        store = self._store
        if store is None:
            return None
        with trio.move_on_after(wait_s):
            for pending in self._serving(store, tokens, max_len):
                await pending.written.wait()
        try:
            for _ in range(_RESTORE_ATTEMPTS):
                info = store.longest_prefix(tokens, max_len=max_len)
                if info is None:
                    return None
                entry = await self._io("read", store.read, info.key)
                if entry is None:
                    continue  # read removed it; try the next longest
                caches = await self._restore_job(store, info, "entry", from_host, entry, self._shapes)
                if caches is None:
                    continue
                self._reads += 1
                return caches, len(entry.tokens)
        except _Stalled:
            pass
        return None

    def _serving(self, store: CacheFileStore, tokens: Sequence[int], max_len: int | None) -> list[_PendingWrite]:
        """Queued writes whose tokens are a prefix of `tokens` longer than the longest stored one."""
        tokens = tuple(tokens)
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        stored = store.longest_prefix(tokens, max_len=max_len)
        have = len(stored.tokens) if stored is not None else 0
        return [p for p in self._queued
                if have < len(p.tokens) <= limit and tokens[: len(p.tokens)] == p.tokens]

    async def drain(self) -> None:
        """Return once every entry offered so far is written or given up (graceful shutdown)."""
        await self._idle.wait()

    def statistics(self) -> PersistenceStatistics:
        store = self._store
        depth = self._inbox.statistics().current_buffer_used
        return PersistenceStatistics(
            enabled=self._open_store is not None, degraded=self._degraded,
            entries=len(store.entries) if store is not None else 0, bytes=store.nbytes if store is not None else 0,
            ssd_reads=self._reads, ssd_writes=self._writes, ssd_errors=self._errors,
            restore_failures=self._restore_failures, dropped=self._dropped,
            queue_depth=depth, mailbox_depth=depth, reason=self._reason,
        )

    async def run(self, *, task_status: trio.TaskStatus[CachePersistenceActor] = trio.TASK_STATUS_IGNORED) -> None:
        """Report started at once, open and scan the directory, then write offered entries until cancelled.

        On exit (stopped or crashed) the entries still queued are given up and
        their caches dropped on the lease thread.
        """
        task_status.started(self)
        try:
            if self._open_store is not None:
                await self._open(self._open_store)
            async for pending in self._inbox:
                try:
                    await self._persist(pending)
                finally:
                    self._finish(pending)
        finally:
            self._unstall.set()
            self.inbox_send.close()
            for pending in drain_nowait(self._inbox):
                self._finish(pending)

    async def _open(self, open_store: OpenStore) -> None:
        try:
            store, shapes = await open_store()
            await self._io("scan", store.scan, directory=store.directory)
        except OSError as exc:
            self._degrade(exc)
            return
        except _Stalled:
            return
        finally:
            self._opened.set()
        self._store, self._shapes = store, shapes
        log.info("prompt cache %s: %d entries, %d bytes on disk", store.directory, len(store.entries), store.nbytes)

    async def _io(self, what: str, fn: Callable[..., T], *args: Any, directory: Path | None = None) -> T:
        """`fn(*args)`, plain file I/O, on a worker thread; `_Stalled` if it overruns `io_timeout_s`.

        An overrun thread is abandoned (a hung disk may hold it until it
        answers; it then only updates the store's index, under its lock) and
        the tier disabled. `directory` names the store's while it is scanned.
        """
        stall = self._unstall if self._faults.take(ACTOR_ID, FaultKind.STALL_IO) else None
        try:
            with trio.fail_after(self._io_timeout_s):
                return await trio.to_thread.run_sync(_file_job, fn, args, stall, abandon_on_cancel=True)
        except trio.TooSlowError:
            store = self._store
            self._stall(what, directory or (store.directory if store is not None else None))
            raise _Stalled from None

    async def _persist(self, pending: _PendingWrite) -> None:
        store = self._store
        if store is None or self._degraded:
            return
        try:
            entry = await self._lease.run(_materialise, pending)
        except LeaseClosed:
            raise
        except Exception:
            self._errors += 1
            log.exception("copying a prompt cache entry to the host failed")
            return
        await self._write_entry(store, entry)

    async def _write_entry(self, store: CacheFileStore, entry: HostEntry) -> StoredEntryInfo | None:
        """Write a materialised entry on a worker thread (faults fire here); its file's info, or None when it was
        not written (a failure loses only this entry)."""
        self._faults.check(ACTOR_ID)  # raise: crash now, between materialising and writing
        if self._faults.take(ACTOR_ID, FaultKind.HANG):
            await trio.sleep_forever()
        fail = self._faults.take(ACTOR_ID, FaultKind.FAIL_WRITE)
        try:
            info = await self._io("write", _write, store, entry, fail)
        except _Stalled:
            return None
        except InjectedFault as exc:
            self._errors += 1
            log.warning("prompt cache write failed: %s", exc)
            return None
        except OSError as exc:
            self._errors += 1
            self._degrade(exc)
            return None
        except Exception:
            self._errors += 1
            log.exception("prompt cache write failed")
            return None
        if info is not None:
            self._writes += 1
        return info

    def _degrade(self, exc: OSError) -> None:
        # Called at most once: writes are sequential, and none is attempted once degraded.
        self._degraded = True
        self._reason = f"directory unusable: {exc}"
        log.warning("prompt cache directory unusable (%s): continuing with the prompt cache in RAM only", exc)

    def _stall(self, what: str, directory: Path | None) -> None:
        """A file operation overran its deadline: no more reads or writes, one warning (the first)."""
        self._store = None
        self._unstall.set()
        if self._reason.startswith("disk stalled"):
            return  # a read and a write may both overrun
        self._degraded = True
        self._reason = f"disk stalled: a {what} in {directory} took over {self._io_timeout_s:g} s"
        log.warning("prompt cache %s: a %s took over %g s (a hung or very slow disk): the SSD tier is off, "
                    "continuing with the prompt cache in RAM only", directory, what, self._io_timeout_s)

    def _finish(self, pending: _PendingWrite) -> None:
        if pending.caches is not None:
            self._lease.free_nowait(pending.release)
        self._queued.remove(pending)
        pending.written.set()
        self._unfinished -= 1
        if self._unfinished == 0:
            self._idle.set()


def store_opener(lease: GpuLease, get_model: Callable[[], Awaitable[LoadedModel]], directory: str | Path,
                 max_bytes: int, step_size: int) -> OpenStore:
    """An `OpenStore` for the served model: waits for it, then derives its `CacheIdentity`.

    `step_size`: `--prefill-step-size`, part of a quantized KV format's identity (`KvScheme.stored_key`).

    The cache layout and shapes need mlx-lm's `make_prompt_cache` (lease);
    hashing the model's files is plain IO (worker thread).
    """
    async def open_store() -> tuple[CacheFileStore, CacheShapes]:
        loaded = await get_model()
        scheme = loaded.kv_scheme
        shapes = await lease.run(cache_shapes, loaded.model, scheme.stored_key(step_size),
                                 (scheme.bits, scheme.group_size) if scheme.bits is not None else None)
        identity = await trio.to_thread.run_sync(identity_of_directory, loaded.path, shapes.layout)
        return CacheFileStore(directory, max_bytes=max_bytes, identity=identity), shapes

    return open_store
