"""Block runs to and from the SSD tier's files (engine/kv/blocks/block_files.py), without a model.

A run copied out of one pool, written by the file store and read back, loads into another pool's free blocks as
cached, keyed blocks that a join then references with exactly the KV the first pool computed; loading leaves the
pool's free-or-evictable count as it was (admission's credit relies on it) and every block released.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_trio.engine.kv.blocks.block_files import RunIndex, block_layout, copy_out, load_in
from mlx_trio.engine.kv.blocks.chain import chain_keys, root_key
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.engine.kv.blocks.storage import BlockStorage, LayerShape
from mlx_trio.engine.prompt_cache.identity import CacheIdentity
from mlx_trio.engine.prompt_cache.namespace import (in_namespace, kv_revision, namespace_of, out_of_namespace,
                                                    revision_namespace)
from mlx_trio.engine.prompt_cache.ssd_files import CacheFileStore, StoredEntryInfo
from tests.engine.kv.test_paged_rows import _value

BS = 4


def _kv(num_blocks: int = 16, dtype: mx.Dtype = mx.bfloat16) -> PagedKV:
    return PagedKV(BlockStorage([LayerShape(1, 1), LayerShape(1, 1)], num_blocks, BS, dtype), "stand-in")


def _feed(kv: PagedKV, rows: list, tokens: list[list[int]]) -> None:
    """test_paged_rows' stand-in forward, into every layer: each new position's value from its row's prefix."""
    step = kv.step(rows, len(tokens[0]))
    values = [[_value(row.tokens[: row.length] + t[: i + 1]) for i in range(len(t))] for row, t in zip(rows, tokens)]
    block = mx.array(values, dtype=mx.float32)[:, None, :, None]  # [B, 1 head, L, 1]
    for layer in range(len(kv.storage.layers)):
        kv.storage.write(layer, step.slots, block, block)
    kv.commit(step, tokens)


def _prefill(kv: PagedKV, prompt: list[int], revision: str = "") -> tuple[tuple[int, ...], tuple[bytes, ...]]:
    """One row (of adapter `revision`) prefills `prompt` and leaves; returns what the leave hook is given (tokens of
    its keyed blocks, keys), checking it names the row's revision."""
    offered = []
    kv.on_release = lambda rev, tokens, keys: offered.append((rev, tokens, keys))
    row = kv.join(prompt, revision)
    _feed(kv, [row], [prompt[row.length:]])
    kv.leave(row)
    kv.on_release = None
    assert len(offered) == 1 and offered[0][0] == revision
    return offered[0][1:]


def _check(kv: PagedKV, rows: list) -> None:
    """Every layer of each row holds its own prefix's stand-in values, in the pool's dtype (test_paged_rows' check)."""
    kv.pool.check()
    for row in rows:
        want = mx.array([_value(row.tokens[: p + 1]) for p in range(row.length)]).astype(kv.storage.dtype)
        for cache in kv.extract(row):
            assert mx.array_equal(cache.keys[0, 0, :, 0], want) and mx.array_equal(cache.values[0, 0, :, 0], want)


def _runs(store: CacheFileStore, kv: PagedKV, tokens, first: int = 0,
          revision: str = "") -> list[tuple[StoredEntryInfo, int, int]]:
    """The stored runs continuing `tokens`' chain (of adapter `revision`) from block `first`, as the actor finds
    them: an index built at a scan, then the revision met."""
    index = RunIndex(kv.root_of, BS)
    for info in store.entries:
        index.add(info)
    index.meet(revision)
    return index.runs(chain_keys(kv.root_of(revision), list(tokens), BS), first, store.holds)


def _store(tmp_path: Path, kv: PagedKV, max_bytes: int = 2**30) -> CacheFileStore:
    store = CacheFileStore(tmp_path, max_bytes=max_bytes, identity=CacheIdentity("m", "t", block_layout(kv)))
    store.scan()
    return store


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_stored_run_loads_into_a_new_pool_as_cached_blocks_a_join_references(tmp_path: Path, dtype) -> None:
    first = _kv(dtype=dtype)
    prompt = list(range(1, 15))  # 3 full blocks, 2 tokens over
    tokens, keys = _prefill(first, prompt)
    assert tokens == tuple(prompt[:12]) and len(keys) == 3
    store = _store(tmp_path, first)
    info = store.write(copy_out(first, tokens, keys, 0))
    assert info is not None and info.start == 0

    second = _kv(dtype=dtype)
    available = second.pool.available()
    ((found, frm, to),) = _runs(store, second, prompt[:12])
    assert (found.key, frm, to) == (info.key, 0, 3)
    assert load_in(second, chain_keys(second.root, prompt[:12], BS), frm, to, store.read(info.key)) == 3
    assert second.pool.idle and second.pool.stats().cached == 3 and second.pool.available() == available
    row = second.join(prompt)
    assert row.cached_tokens == 12
    _check(second, [row])  # the loaded KV is what the first pool computed for these tokens
    _feed(second, [row], [prompt[12:]])
    _check(second, [row])
    second.leave(row)
    second.pool.check()
    assert second.pool.idle


def test_a_longer_prompt_stores_only_the_blocks_after_the_stored_run(tmp_path: Path) -> None:
    kv = _kv()
    store = _store(tmp_path, kv)
    short = list(range(1, 10))  # 2 full blocks
    tokens, keys = _prefill(kv, short)
    store.write(copy_out(kv, tokens, keys, 0))
    longer = short[:8] + list(range(50, 62))  # the same 2 blocks, then 3 more
    tokens, keys = _prefill(kv, longer)
    stored = _runs(store, kv, tokens)
    assert [(frm, to) for _, frm, to in stored] == [(0, 2)]
    info = store.write(copy_out(kv, tokens, keys, stored[-1][2]))
    assert info is not None and info.start == 8 and len(info.tokens) == 20
    assert store.read(info.key).arrays["k.0"].shape[0] == 3  # its own blocks only: the shared two are stored once

    fresh = _kv()
    wanted = tuple(longer[:20])
    runs = _runs(store, fresh, wanted)
    assert [(frm, to) for _, frm, to in runs] == [(0, 2), (2, 5)]
    keys = chain_keys(fresh.root, wanted, BS)
    assert load_in(fresh, keys, 2, 5, store.read(runs[1][0].key)) == 0  # its head is not in the pool: unreachable
    for entry_info, frm, to in runs:
        assert load_in(fresh, keys, frm, to, store.read(entry_info.key)) == to
    row = fresh.join(list(longer) + [7])
    assert row.cached_tokens == 20
    _check(fresh, [row])
    fresh.leave(row)
    assert fresh.pool.idle


def test_a_chain_stored_again_from_its_start_is_a_file_of_its_own(tmp_path: Path) -> None:
    """Runs [0, 2) and [2, 5) stored, then the first evicted: the chain is written again from block 0 as [0, 5),
    which shares its tokens with [2, 5) but not its start, so it is a new file (not "already stored")."""
    kv = _kv()
    store = _store(tmp_path, kv)
    prompt = list(range(1, 22))  # 5 full blocks
    tokens, keys = _prefill(kv, prompt)
    head = store.write(copy_out(kv, tokens, keys, 0, max_blocks=2))
    tail = store.write(copy_out(kv, tokens, keys, 2))
    assert (head.start, tail.start, len(tail.tokens)) == (0, 8, 20)
    store.remove(head.key)
    assert _runs(store, kv, tokens) == []  # the tail alone is unreachable
    whole = store.write(copy_out(kv, tokens, keys, 0))
    assert whole.key != tail.key and whole.tokens == tail.tokens and whole.start == 0
    assert [(info.key, frm, to) for info, frm, to in _runs(store, kv, tokens)] == [(whole.key, 0, 5)]
    again = CacheFileStore(tmp_path, max_bytes=2**30, identity=store.identity)
    assert sorted((e.start, len(e.tokens)) for e in again.scan()) == [(0, 20), (8, 20)]  # names check out at a scan


def _five_blocks_stored(tmp_path: Path) -> tuple[list[int], CacheFileStore, StoredEntryInfo]:
    """A 21-token prompt's 5 full blocks prefilled into a pool and stored as one run: the prompt, store, run."""
    big = _kv()
    prompt = list(range(1, 22))
    tokens, keys = _prefill(big, prompt)
    store = _store(tmp_path, big)
    info = store.write(copy_out(big, tokens, keys, 0))
    assert info is not None
    return prompt, store, info


def test_loading_into_a_full_pool_loads_what_fits_and_leaks_nothing(tmp_path: Path) -> None:
    prompt, store, info = _five_blocks_stored(tmp_path)
    small = _kv(num_blocks=4)
    holder = small.join([9] * 9)
    _feed(small, [holder], [holder.tokens])  # 3 blocks used, 1 free
    n = load_in(small, chain_keys(small.root, prompt[:20], BS), 0, 5, store.read(info.key))
    assert n == 1 and small.pool.stats().cached == 1
    small.leave(holder)
    small.pool.check()
    assert small.pool.idle


def test_loading_never_evicts_the_chain_blocks_it_continues(tmp_path: Path) -> None:
    """The pool holds the chain's first 2 blocks (cached, evictable) and 1 free block when a run of blocks 0..4
    is loaded: only block 2 is loaded, into the free one, and the cached 2 stay (evicting them for blocks 2..4
    would leave a chain no lookup can reach)."""
    prompt, store, info = _five_blocks_stored(tmp_path)
    small = _kv(num_blocks=5)
    _prefill(small, prompt[:9])  # blocks 0..1 of the chain, cached
    holder = small.join([9] * 7)
    _feed(small, [holder], [holder.tokens])  # 2 blocks used: 1 free, 2 cached
    assert load_in(small, chain_keys(small.root, prompt[:20], BS), 0, 5, store.read(info.key)) == 3
    small.leave(holder)
    row = small.join(prompt)
    assert row.cached_tokens == 12
    _check(small, [row])
    small.leave(row)
    assert small.pool.idle


def test_a_run_of_another_shape_is_refused_with_nothing_allocated(tmp_path: Path) -> None:
    kv = _kv()
    tokens, keys = _prefill(kv, list(range(1, 10)))
    entry = copy_out(kv, tokens, keys, 0)
    other = PagedKV(BlockStorage([LayerShape(2, 1), LayerShape(1, 1)], 8, BS, mx.bfloat16), "stand-in")
    with pytest.raises(ValueError):
        load_in(other, chain_keys(other.root, list(tokens), BS), 0, 2, entry)
    assert other.pool.idle and other.pool.stats().free == 8
    assert block_layout(other) != block_layout(kv)


@given(stored=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(0, 2)), max_size=6),
       query=st.tuples(st.integers(1, 8), st.integers(0, 2)), first=st.integers(0, 3), gone=st.sets(st.integers(0, 5)))
def test_the_run_index_continues_the_chain_block_by_block(stored, query, first, gone) -> None:
    """Each run found starts at or before the block wanted and agrees with the query through its reach; the runs
    are contiguous from `first`; they reach as far as any stored run could take the chain; runs no longer stored
    are never returned."""
    def tokens(n_blocks: int, variant: int) -> tuple[int, ...]:
        return tuple(1 + (i // (2 * BS)) * variant * 7 + i for i in range(n_blocks * BS))

    root = root_key("m")
    entries = [StoredEntryInfo(f"{i}", tokens(start + length, variant), 0, Path("x"), start * BS)
               for i, (start, length, variant) in enumerate(stored)]
    index = RunIndex(lambda revision: root_key("m", revision), BS)
    for info in entries:
        index.add(info)
    alive = [e for e in entries if int(e.key) not in gone]
    want = tokens(*query)
    runs = index.runs(chain_keys(root, want, BS), first, lambda key: int(key) not in gone)
    at = first
    for info, frm, to in runs:
        assert frm == at and info.start <= frm * BS and to > frm and int(info.key) not in gone
        assert info.tokens[: to * BS] == want[: to * BS]
        at = to
    # No stored run could take the chain one block further.
    assert not any(e.start <= at * BS < len(e.tokens) and e.tokens[: (at + 1) * BS] == want[: (at + 1) * BS]
                   and (at + 1) * BS <= len(want) for e in alive)


def test_an_adapter_run_is_in_its_revision_namespace_and_serves_only_that_revision(tmp_path: Path) -> None:
    """The same tokens prefilled by the base model and by revision "r1": two files (the adapter's tokens in the
    revision's namespace, its metadata naming it), each found only for its own revision; a run loads only for the
    revision that computed it."""
    kv = _kv()
    store = _store(tmp_path, kv)
    prompt = list(range(1, 14))  # 3 full blocks
    base = store.write(copy_out(kv, *_prefill(kv, prompt), 0))
    tokens, keys = _prefill(kv, prompt, "r1")
    entry = copy_out(kv, tokens, keys, 0, revision="r1")
    assert entry.tokens == in_namespace(prompt[:12], revision_namespace("r1")) and "r1" in entry.meta["states"]
    adapter = store.write(entry)
    assert base.key != adapter.key and base.tokens == tuple(prompt[:12])
    again = CacheFileStore(tmp_path, max_bytes=2**30, identity=store.identity)
    assert sorted(e.tokens for e in again.scan()) == sorted([base.tokens, entry.tokens])  # int64 tokens kept

    assert [(i.key, f, t) for i, f, t in _runs(again, kv, prompt[:12])] == [(base.key, 0, 3)]
    assert [(i.key, f, t) for i, f, t in _runs(again, kv, prompt[:12], revision="r1")] == [(adapter.key, 0, 3)]
    assert _runs(again, kv, prompt[:12], revision="r2") == []  # another revision (under any name): nothing

    fresh = _kv()
    r1 = chain_keys(fresh.root_of("r1"), prompt[:12], BS)
    with pytest.raises(ValueError, match="revision"):  # a run read for another revision's chain
        load_in(fresh, r1, 0, 3, again.read(base.key), "r1")
    with pytest.raises(ValueError, match="revision"):
        load_in(fresh, chain_keys(fresh.root, prompt[:12], BS), 0, 3, again.read(adapter.key))
    assert fresh.pool.idle and fresh.pool.stats().free == 16
    assert load_in(fresh, r1, 0, 3, again.read(adapter.key), "r1") == 3
    assert fresh.join(prompt).cached_tokens == 0  # the base model's row finds none of the adapter's blocks
    row = fresh.join(prompt, "r1")
    assert row.cached_tokens == 12
    _check(fresh, [row])
    fresh.leave(row)
    fresh.pool.check()


def test_runs_of_a_revision_not_met_are_kept_aside_until_it_is() -> None:
    root_of = lambda revision: root_key("m", revision)  # noqa: E731
    tokens = tuple(range(1, 9))  # 2 blocks
    ns = revision_namespace("r1")
    index = RunIndex(root_of, BS)
    info = StoredEntryInfo("a", in_namespace(tokens, ns), 0, Path("x"))
    index.add(info)
    keys = chain_keys(root_of("r1"), tokens, BS)
    assert not index.met("r1") and index.met("") and index.aside("r1") == [info]
    assert index.runs(keys, 0, lambda key: True) == []  # not keyed yet
    index.meet("r1", {"a": index.run_keys(info, "r1")})
    assert index.met("r1") and index.aside("r1") == []
    assert index.runs(keys, 0, lambda key: True) == [(info, 0, 2)]
    longer = tokens + (9, 10, 11, 12)
    index.add(StoredEntryInfo("b", in_namespace(longer, ns), 0, Path("x"), 8))  # met: keyed as added
    found = index.runs(chain_keys(root_of("r1"), longer, BS), 0, lambda key: True)
    assert [(i.key, f, t) for i, f, t in found] == [("a", 0, 2), ("b", 2, 3)]
    index.add(StoredEntryInfo("c", in_namespace(tokens, revision_namespace("r2")), 0, Path("x")))
    index.drop("c")  # dropped while aside: never keyed
    index.meet("r2")
    assert index.runs(chain_keys(root_of("r2"), tokens, BS), 0, lambda key: True) == []


@given(stored=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(0, 1), st.sampled_from("xab")),
                       max_size=8),
       meets=st.lists(st.tuples(st.integers(0, 8), st.sampled_from("ab")), max_size=4),
       query=st.tuples(st.integers(1, 7), st.integers(0, 1)), revision=st.sampled_from("xab"))
def test_runs_indexed_before_or_after_their_revision_is_met_are_found_alike(stored, meets, query, revision) -> None:
    """Runs of three revisions ("" and two adapters) added in any order with the adapters met at any point: once a
    revision is met, a lookup of its chain finds what an index holding only that revision's runs finds, and never
    a run of another revision."""
    def rev(name: str) -> str:
        return "" if name == "x" else name

    def tokens(n_blocks: int, variant: int) -> tuple[int, ...]:
        return tuple(1 + (i // (2 * BS)) * variant * 7 + i for i in range(n_blocks * BS))

    root_of = lambda r: root_key("m", r)  # noqa: E731
    entries = [StoredEntryInfo(f"{i}", in_namespace(tokens(start + length, variant), revision_namespace(rev(name))),
                               0, Path("x"), start * BS) for i, (start, length, variant, name) in enumerate(stored)]
    index = RunIndex(root_of, BS)
    for at, info in enumerate([*entries, None]):
        for when, name in meets:
            if when == at:
                index.meet(rev(name))
        if info is not None:
            index.add(info)
    index.meet(rev(revision))
    alone = RunIndex(root_of, BS)
    alone.meet(rev(revision))
    ns = revision_namespace(rev(revision))
    for info in entries:
        if info.tokens[0] >> 32 << 32 == ns:
            alone.add(info)
    keys = chain_keys(root_of(rev(revision)), tokens(*query), BS)
    found = index.runs(keys, 0, lambda key: True)
    assert [(f, t) for _, f, t in found] == [(f, t) for _, f, t in alone.runs(keys, 0, lambda key: True)]
    assert all(info.tokens[0] >> 32 << 32 == ns for info, _, _ in found)


@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20), name=st.text(max_size=4),
       revision=st.text(max_size=8))
def test_a_runs_namespace_is_read_back_from_its_tokens(tokens, name, revision) -> None:
    """A run's tokens name their revision's namespace (the base model's is 0), and give back the plain ids; tokens
    of two namespaces are of none."""
    kv = kv_revision(name, revision)
    space = revision_namespace(kv)
    assert space and space % 2**32 == 0 and revision_namespace("") == 0
    keys = in_namespace(tokens, space)
    assert namespace_of(keys) == space and out_of_namespace(keys, space) == tuple(tokens)
    assert namespace_of(tokens) == 0
    assert namespace_of(keys + (tokens[0],)) is None
