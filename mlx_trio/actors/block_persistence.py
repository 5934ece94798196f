"""The SSD tier under --kv-layout paged: the pool's keyed blocks written as runs, and read back into free blocks.

With paged KV the prompt cache is the pool's cached blocks (engine/kv/blocks/),
so the SSD tier stores blocks, not entries (docs/prompt-cache-ssd.md, "Paged
KV blocks"). It is the cache-persistence actor (same child id, queue, faults,
file store, identity, byte cap, LRU and degrading rules) with two changes:

* **Writes happen when a row leaves** (`PagedKV.on_release`, on the lease
  thread, handed to this actor's inbox through the Trio token): its keyed
  blocks, less the run of them already stored, are copied to the host in a
  lease job (`block_files.copy_out`) and written as one file on a worker
  thread. Writing at release, not at eviction from the pool's LRU, is what
  lets a restarted engine find the prefixes of finished requests: a pool
  that never fills never evicts, and a restart loses every cached block.
  A block evicted before its lease job ran is simply not written (only a cache).
* **Restores happen at admission** (`restore_blocks`, before the head's pin):
  the stored runs that continue the blocks the pool already holds are read
  on a worker thread and loaded into free blocks in a lease job
  (`block_files.load_in`), keyed and cached, so the pin that follows finds,
  credits and holds them as any cached block. Loading leaves the pool's
  free-or-evictable count unchanged (the loaded blocks are evictable), so
  admission's reservations stay true.

Adapter rows are stored too. Their blocks are keyed under the adapter's
name and the hash of its files (`namespace.kv_revision`), so a restarted
server serving the same files under the same name computes the same keys: a
run holds its tokens in that revision's namespace (block_files.py) and is
keyed once the revision is first met (a row of it leaving, or a restore for
it), since the scan cannot know which adapters will be served. A restore is
for one revision (admission passes the one its name serves now): the base
model, another revision, or an adapter no longer served never finds
another's runs.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from mlx_trio.actors.cache_persistence import ACTOR_ID, CachePersistenceActor, OpenStore, _Stalled
from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.engine.kv.blocks.block_files import RunIndex, block_layout, copy_out, load_in
from mlx_trio.engine.kv.blocks.chain import Key, chain_keys
from mlx_trio.engine.model.load import LoadedModel
from mlx_trio.engine.prompt_cache.identity import identity_of_directory
from mlx_trio.engine.prompt_cache.ssd_files import CacheFileStore
from mlx_trio.errors import LeaseClosed

log = logging.getLogger("mlx_trio.cache_persistence")

# Under the --prompt-cache-dir: a padded server's entries and a paged server's block runs never meet (each
# server's scan removes files of another layout; the two kinds share the directory's name, not its files).
BLOCKS_SUBDIRECTORY = "blocks"
# Bytes of blocks one file (and one lease job's copy to the host) holds at most: a 100k-token row of a 1B model
# (32 KiB a token) is 50 files written one after another, each lease job short enough for decode steps between.
RUN_BYTES = 64 << 20
# Released chains waiting for the disk. Unlike a padded entry, one holds no device memory (its blocks are read
# when its turn comes), so the queue can be long; past it a chain is dropped (only a cache).
BLOCK_QUEUE = 64

__all__ = ["ACTOR_ID", "BLOCKS_SUBDIRECTORY", "BlockPersistenceActor", "block_store_opener"]


@attrs.define(eq=False)
class _PendingChain:
    """A leaving row's keyed blocks: its chain's tokens (whole blocks), keys and adapter revision ("": the base
    model). Holds no device memory."""

    tokens: tuple[int, ...]
    keys: tuple[Key, ...]
    revision: str = ""
    caches: None = None  # nothing to drop on the lease thread (see `CachePersistenceActor._finish`)
    written: trio.Event = attrs.field(factory=trio.Event)


class BlockPersistenceActor(CachePersistenceActor):
    """The cache-persistence actor for a paged pool: see the module docstring.

    `get_model` gives the loaded model whose `paged_kv` pool it serves; `open_store` is `block_store_opener`'s.
    """

    def __init__(self, lease: GpuLease, open_store: OpenStore | None, get_model: Callable[[], Awaitable[LoadedModel]],
                 **options: Any) -> None:
        super().__init__(lease, open_store, **{"max_queue": BLOCK_QUEUE, **options})
        self._get_model = get_model
        self._paged: Any = None
        self._runs: RunIndex | None = None  # the stored runs by chain key, built at the scan
        self._indexed = trio.Event()  # set once the runs are indexed (or the directory found unusable)
        self._hook: Callable[[str, tuple[int, ...], tuple[Key, ...]], None] | None = None

    async def run(self, *, task_status: trio.TaskStatus[CachePersistenceActor] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await super().run(task_status=task_status)
        finally:
            paged = self._paged
            if paged is not None and paged.on_release is self._hook:
                paged.on_release = None  # a restarted actor installs its own

    async def _open(self, open_store: OpenStore) -> None:
        try:
            self._paged = (await self._get_model()).paged_kv
            await super()._open(open_store)
            store = self._store
            if store is None:
                return
            runs = RunIndex(self._paged.peek_root, self._paged.block_size)  # off the lease thread: see peek_root
            # Hashing every stored block's chain key is plain CPU work: off the Trio thread.
            await trio.to_thread.run_sync(lambda: [runs.add(info) for info in store.entries])
            self._runs = runs
        finally:
            self._indexed.set()  # restores wait for it: a restarted server's first requests are the ones to serve
        token = trio.lowlevel.current_trio_token()

        def hook(revision: str, tokens: tuple[int, ...], keys: tuple[Key, ...]) -> None:  # lease thread
            try:
                token.run_sync_soon(self._offer_chain, revision, tokens, keys)
            except trio.RunFinishedError:
                pass  # the engine is gone: nothing to write to

        self._hook = self._paged.on_release = hook

    def _offer_chain(self, revision: str, tokens: tuple[int, ...], keys: tuple[Key, ...]) -> None:
        """Trio thread: queue a released chain (computed with adapter `revision`) unless the tier is off."""
        if self._store is None or self._degraded or self._paged is None:
            return
        self._enqueue(_PendingChain(tokens, keys, revision))

    async def _meet(self, revision: str) -> None:
        """Key the stored runs of `revision` kept aside since the scan (`RunIndex.meet`), hashing them off the Trio
        thread; a no-op once met."""
        runs = self._runs
        if runs is None or runs.met(revision):
            return
        aside = runs.aside(revision)
        keys: dict[str, list[Key]] = {}
        if aside:
            keys = await trio.to_thread.run_sync(lambda: {info.key: runs.run_keys(info, revision) for info in aside})
        runs.meet(revision, keys)

    async def drain(self) -> None:
        """As the base's, after one lease job: a row that left in a job before it has been offered (the hook's
        call was queued on the Trio loop before the job's result)."""
        if self._paged is not None:
            try:
                await self._lease.run(lambda: None)
            except LeaseClosed:
                pass
        await super().drain()

    async def _persist(self, pending: Any) -> None:
        store, paged = self._store, self._paged
        if store is None or self._degraded or paged is None or not isinstance(pending, _PendingChain):
            return
        assert self._runs is not None  # set with the store
        await self._meet(pending.revision)  # its runs already on disk count as stored
        stored = self._runs.runs(pending.keys, 0, store.holds)
        first = stored[-1][2] if stored else 0  # the chain's blocks already on disk, from its start
        per_file = max(1, RUN_BYTES // paged.storage.bytes_per_block)
        while first < len(pending.keys) and not self._degraded and self._store is store:
            try:
                entry = await self._lease.run(copy_out, paged, pending.tokens, pending.keys, first, per_file,
                                              pending.revision)
            except LeaseClosed:
                raise
            except Exception:
                self._errors += 1
                log.exception("copying KV blocks to the host failed")
                return
            if entry is None:
                return  # evicted before its turn: the rest of the chain is not written
            info = await self._write_entry(store, entry)
            if info is None:
                return  # a run after a missing one would be unreachable
            self._runs.add(info)
            first = len(entry.tokens) // paged.block_size

    async def restore_blocks(self, prompt: Sequence[int], revision: str = "") -> int:
        """Load the stored blocks that continue the pool's cached prefix of `prompt` (all but its last token, as a
        join looks up) for a row computed with adapter `revision` ("": the base model); returns the tokens loaded.
        Never raises for a bad file (removed, counted, a miss).

        Raises:
          LeaseClosed: the lease stopped while loading.
        """
        if self._open_store is not None:
            await self._indexed.wait()
        store, paged, runs = self._store, self._paged, self._runs
        if store is None or paged is None or runs is None:
            return 0
        bs = paged.block_size
        tokens = tuple(prompt[: (len(prompt) - 1) // bs * bs])
        if not tokens or not paged.pool.available():  # a hint: no room, nothing to read files for
            return 0
        await self._meet(revision)
        keys = chain_keys(runs.root_of(revision), tokens, bs)
        # A hint read off the lease thread (plain dict reads); the load job checks again.
        have = len(paged.pool.lookup(keys))
        loaded = 0
        try:
            for info, frm, to in runs.runs(keys, have, store.holds):
                entry = await self._io("read", store.read, info.key)
                if entry is None:
                    break  # unusable (removed) or gone: the rest of the chain is unreachable now
                reach = await self._restore_job(store, info, "block file", load_in, paged, keys, frm, to, entry,
                                                revision)
                if reach is None:
                    break
                loaded += max(0, reach - frm)
                if reach < to:
                    break  # the pool had no room, or its earlier blocks were evicted meanwhile
        except _Stalled:
            pass
        if loaded:
            self._reads += 1
        return loaded * bs


def block_store_opener(lease: GpuLease, get_model: Callable[[], Awaitable[LoadedModel]], directory: str | Path,
                       max_bytes: int) -> OpenStore:
    """An `OpenStore` for the paged pool's block files, in `directory`/blocks, under the model's identity and the
    pool's block layout (`block_files.block_layout`); no cache shapes (a run is checked against the pool)."""
    async def open_store() -> tuple[CacheFileStore, Any]:
        loaded = await get_model()
        layout = await lease.run(block_layout, loaded.paged_kv)  # reads the pool's dtype: an MLX object
        identity = await trio.to_thread.run_sync(identity_of_directory, loaded.path, layout)
        return CacheFileStore(Path(directory) / BLOCKS_SUBDIRECTORY, max_bytes=max_bytes, identity=identity), None

    return open_store
