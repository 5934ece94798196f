"""Keyed KV blocks to and from the SSD tier's files: runs of consecutive chain blocks, one file a run.

A run is blocks `first .. end-1` of one chain (chain.py). Its file is an entry
of the SSD tier's `CacheFileStore` (engine/prompt_cache/ssd_files.py), so it
shares that tier's identity, atomic writes, checks, byte cap and LRU: its
`tokens` are the chain's tokens from the start through the run's last block
(what names the run, as the chain key does, and what a lookup matches by
prefix), `start` is `first * block_size`, and its arrays are the run's blocks,
`k.<layer>` / `v.<layer>` of shape `[end - first, block_size, kv_heads,
head_dim]` (bfloat16 kept as uint16 bits). A run after an earlier one of the
same chain stores only its own blocks: a shared prefix is on disk once.

A run of an adapter row's blocks carries its tokens in the namespace of the
revision that computed them (engine/prompt_cache/namespace.py,
`revision_namespace`), so a base run and an adapter run of the same tokens
are two files, and its metadata names that revision (checked at load).

Runs are found by chain key (`RunIndex`: each stored block's key -> its run),
so a lookup costs a dict read a block, whatever the number of files.
`copy_out` and `load_in` run on the lease thread (MLX); `RunIndex` and
`block_layout` are plain Python for the actor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_trio.engine.kv.blocks.chain import Key, chain_keys
from mlx_trio.engine.prompt_cache.host_entry import CLASSES, START, STATES, HostEntry
from mlx_trio.engine.prompt_cache.namespace import in_namespace, namespace_of, out_of_namespace, revision_namespace

# The class name a block run's entry carries (a padded entry carries mlx-lm cache classes).
RUN_CLASS = "PagedBlocks"


def block_layout(paged: Any) -> str:
    """The identity layout of a pool's block files: block size, dtype, per-layer shapes (runs collapsed) and the
    MLX version that computed them.

    A file is usable only by a pool of the same layout (another block size or head shape is removed at scan). The
    MLX version is in because a block is raw KV that another build's kernels may round differently: a row reading
    it would then drift from one that computed it (the padded tier's entries do not carry it)."""
    storage = paged.storage
    shapes: list[list[Any]] = []
    for shape in storage.layers:
        name = f"{shape.kv_heads}x{shape.head_dim}"
        if shapes and shapes[-1][0] == name:
            shapes[-1][1] += 1
        else:
            shapes.append([name, 1])
    layers = ",".join(name if n == 1 else f"{name}*{n}" for name, n in shapes)
    return f"{RUN_CLASS}:{storage.block_size}:{storage.dtype}:{layers}:mlx-{mx.__version__}"


class RunIndex:
    """Which stored runs hold each block of a chain: chain key -> the runs' `StoredEntryInfo`s (plain Python).

    A lookup walks a chain's keys from a block on and finds the longest stored continuation: a dict read a
    block, however many files there are. Keys come from each run's tokens under its revision's root
    (`root_of(revision)`, "" the base model's), at the scan and after each write; a run the store no longer
    holds (evicted, removed) is dropped when met.

    A run in an adapter revision's namespace is keyed only once that revision is met (`meet`: something asked
    for it), since a namespace names its revision only by a hash: until then it is kept aside. Base runs are
    keyed as added. Two revisions sharing a namespace (one chance in 2**28) share its runs' keys with the first
    met; `load_in` refuses a run computed with another revision, so no row reads another's KV.
    """

    def __init__(self, root_of: Callable[[str], Key], block_size: int) -> None:
        self.root_of, self.block_size = root_of, block_size
        # Usually one run a block; two after a chain was stored again from an earlier block (a run before it gone).
        self._runs_of: dict[Key, dict[str, Any]] = {}
        self._keys_of: dict[str, list[Key]] = {}  # a run's own block keys, by file key (to drop them)
        self._met: dict[int, str] = {0: ""}  # namespace -> the revision its runs are keyed under
        self._aside: dict[int, dict[str, Any]] = {}  # namespace not met yet -> its runs, by file key

    def add(self, info: Any) -> None:
        """Index a stored run (a `StoredEntryInfo` with `tokens` from the chain's start and `start`), or keep it
        aside until its namespace's revision is met."""
        self.drop(info.key)
        namespace = namespace_of(info.tokens)
        if namespace is None:
            return  # tokens of no one namespace: no chain of ours leads to it
        revision = self._met.get(namespace)
        if revision is None:
            self._aside.setdefault(namespace, {})[info.key] = info
        else:
            self._index(info, self.run_keys(info, revision))

    def met(self, revision: str) -> bool:
        """Whether runs of `revision`'s namespace are keyed (the base model's always are)."""
        return revision_namespace(revision) in self._met

    def aside(self, revision: str) -> list[Any]:
        """The runs kept aside for `revision`'s namespace (none once it is met)."""
        if self.met(revision):
            return []
        return list(self._aside.get(revision_namespace(revision), {}).values())

    def run_keys(self, info: Any, revision: str) -> list[Key]:
        """The chain keys of a run's own blocks computed with `revision`. Reads nothing of the index (any thread:
        the hashing of many runs is for a worker thread, then `meet`)."""
        tokens = out_of_namespace(info.tokens, revision_namespace(revision))
        return chain_keys(self.root_of(revision), tokens, self.block_size)[info.start // self.block_size :]

    def meet(self, revision: str, keys: Mapping[str, list[Key]] | None = None) -> None:
        """Key the runs kept aside for `revision`'s namespace, and its runs added from now on; a no-op once met.
        `keys`: `run_keys` of some of them computed beforehand, by file key (the rest are computed here)."""
        namespace = revision_namespace(revision)
        if namespace in self._met:
            return
        self._met[namespace] = revision
        keys = keys or {}
        for info in self._aside.pop(namespace, {}).values():
            self._index(info, keys.get(info.key) or self.run_keys(info, revision))

    def _index(self, info: Any, keys: list[Key]) -> None:
        self._keys_of[info.key] = keys
        for key in keys:
            self._runs_of.setdefault(key, {})[info.key] = info

    def drop(self, file_key: str) -> None:
        for key in self._keys_of.pop(file_key, ()):
            runs = self._runs_of.get(key)
            if runs is not None:
                runs.pop(file_key, None)
                if not runs:
                    del self._runs_of[key]
        for aside in self._aside.values():  # one a revision on disk not met yet: few
            aside.pop(file_key, None)

    def runs(self, keys: Sequence[Key], first: int, stored: Callable[[str], bool]) -> list[tuple[Any, int, int]]:
        """The stored runs that continue the chain `keys` from block `first`, in order: `(info, from, to)` blocks,
        each the one reaching furthest (a run may serve only part of itself: a prompt that stops inside it).
        Stops at the first block no run holds; `stored(file_key)` says whether a run is still on disk."""
        out: list[tuple[Any, int, int]] = []
        at = first
        while at < len(keys):
            best, reach = None, at
            for info in list(self._runs_of.get(keys[at], {}).values()):
                if not stored(info.key):
                    self.drop(info.key)
                    continue
                to = at + 1
                while to < len(keys) and info.key in self._runs_of.get(keys[to], ()):
                    to += 1
                if to > reach:
                    best, reach = info, to
            if best is None:
                break
            out.append((best, at, reach))
            at = reach
        return out


def copy_out(paged: Any, tokens: Sequence[int], keys: Sequence[Key], first: int,
             max_blocks: int | None = None, revision: str = "") -> HostEntry | None:
    """The run of `keys[first:]` still keyed in the pool (used or cached), at most `max_blocks` of it, copied to the
    host; None if none is. `revision`: the adapter revision the chain was computed with ("" the base model): the
    entry's tokens are in its namespace and its metadata names it.

    Lease thread. Reads blocks, changes nothing: a block evicted since its row released it ends the run."""
    end = len(keys) if max_blocks is None else min(len(keys), first + max_blocks)
    blocks = paged.pool.lookup(keys[first:end])
    if not blocks:
        return None
    bs = paged.block_size
    ids = mx.array(blocks, dtype=mx.int32)
    arrays: dict[str, np.ndarray] = {}
    for layer in range(len(paged.storage.layers)):
        for name, pool in (("k", paged.storage.keys[layer]), ("v", paged.storage.values[layer])):
            arrays[f"{name}.{layer}"] = _to_numpy(mx.take(pool, ids, axis=0))
    states: dict[str, Any] = {"block_size": bs, "dtype": str(paged.storage.dtype)}
    if revision:
        states["revision"] = revision
    meta = {CLASSES: json.dumps([RUN_CLASS]), STATES: json.dumps(states), START: str(first * bs)}
    return HostEntry(in_namespace(tokens[: (first + len(blocks)) * bs], revision_namespace(revision)), arrays, meta)


def load_in(paged: Any, keys: Sequence[Key], frm: int, to: int, entry: HostEntry, revision: str = "") -> int:
    """Blocks `frm .. to-1` of the chain `keys` (computed with adapter `revision`, "" the base model) from `entry` (a
    stored run holding them) into free blocks of the pool, keyed and cached (unreferenced: the caller's pin or a
    row's join takes them); returns how many of the chain's blocks the pool now holds from its start (`to` when
    the whole run is in).

    Lease thread. Loads nothing when the chain's blocks before `frm` are no longer all in the pool (a run after
    them would be unreachable); fewer when the pool has fewer blocks free or evictable. Blocks that came into the
    pool meanwhile are skipped. Raises ValueError when the entry does not fit the pool (another layout that passed
    its checksum, or a run another revision computed), with nothing allocated. Leaves the pool's counts as it found
    them: loaded blocks are cached.
    """
    pool, bs, storage = paged.pool, paged.block_size, paged.storage
    _check_fits(paged, entry, revision)
    before = pool.lookup(keys[:to])  # past `frm` too: a row may have computed some since the run was chosen
    if len(before) < frm:
        return len(before)
    frm = len(before)
    skip = frm - int(entry.meta[START]) // bs
    if frm >= to or skip < 0:
        return frm
    for block in before:  # the chain's blocks before the loaded ones: not evictable while this job allocates
        pool.retain(block)
    blocks: list[int] = []
    try:
        blocks = pool.allocate(min(to - frm, pool.available()))
        if not blocks:
            return frm
        n = len(blocks)
        ids = mx.array(blocks, dtype=mx.int32)
        for layer in range(len(storage.layers)):
            for name, arrays in (("k", storage.keys), ("v", storage.values)):
                data = entry.arrays[f"{name}.{layer}"][skip : skip + n]
                arrays[layer][ids] = _from_numpy(data, storage.dtype)  # in place: the list's array is the result
        mx.eval(storage.keys, storage.values)
        reach = frm
        for block, key in zip(blocks, keys[frm : frm + n]):
            if not pool.register(block, key):  # another block holds it now: the chain goes on through that one
                break
            reach += 1
        return reach
    finally:
        pool.release(blocks)
        pool.release(before)


def _check_fits(paged: Any, entry: HostEntry, revision: str) -> None:
    storage = paged.storage
    states = json.loads(entry.meta[STATES])
    if json.loads(entry.meta[CLASSES]) != [RUN_CLASS] or states.get("block_size") != paged.block_size:
        raise ValueError("not a block run of this pool's block size")
    if states.get("revision", "") != revision:
        raise ValueError("a block run computed with another adapter revision")
    start = int(entry.meta[START])
    n = len(entry.tokens) // paged.block_size - start // paged.block_size
    if start % paged.block_size or len(entry.tokens) % paged.block_size or n < 1:
        raise ValueError(f"a run of {len(entry.tokens)} tokens from {start} is not whole blocks")
    for layer, shape in enumerate(storage.layers):
        want = (n, paged.block_size, shape.kv_heads, shape.head_dim)
        for name in ("k", "v"):
            data = entry.arrays.get(f"{name}.{layer}")
            if data is None or tuple(data.shape) != want or data.dtype != _numpy_dtype(storage.dtype):
                raise ValueError(f"layer {layer}'s {name} is not {want} of {storage.dtype}")
    if len(entry.arrays) != 2 * len(storage.layers):
        raise ValueError("a run with arrays for another layer count")


def _numpy_dtype(dtype: mx.Dtype) -> np.dtype:
    return np.dtype(np.uint16) if dtype == mx.bfloat16 else np.dtype(str(dtype).rsplit(".", 1)[-1])


def _to_numpy(a: mx.array) -> np.ndarray:
    # numpy has no bfloat16: keep the bits (the file store writes them as U16, as the padded tier does)
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(np.ascontiguousarray(a))
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out
