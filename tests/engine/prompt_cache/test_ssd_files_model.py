"""`CacheFileStore` against a model: random writes, reads, removals and restarts, checked after every step."""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_trio.engine.prompt_cache.ssd_files import SUFFIX, CacheFileStore
from mlx_trio.engine.prompt_cache.identity import CacheIdentity
from mlx_trio.engine.prompt_cache.host_entry import CLASSES, STATES, HostEntry, same_entry

IDENTITY = CacheIdentity("m", "t", "KVCache")
DTYPES = [np.float32, np.float16, np.uint16, np.int32, np.bool_]

tokens_st = st.lists(st.integers(0, 2), max_size=4).map(tuple)  # few values, short: collisions and prefixes


@st.composite
def entries(draw: st.DrawFn) -> HostEntry:
    tokens = draw(tokens_st)
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    arrays = {}
    for i in range(draw(st.integers(0, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 12), min_size=0, max_size=2)))
        dtype = draw(st.sampled_from(DTYPES))
        arrays[f"{i}.{i}"] = np.asarray(rng.standard_normal(shape) * 100).astype(dtype)  # 0-d stays an array
    return HostEntry(tokens, arrays, {CLASSES: f"[{seed}]", STATES: draw(st.text(max_size=5))})


ops = st.one_of(
    st.tuples(st.just("write"), entries()),
    st.tuples(st.just("read"), tokens_st),
    st.tuples(st.just("remove"), tokens_st),
    st.tuples(st.just("prefix"), tokens_st),
    st.tuples(st.just("restart"), st.none()),
)


@settings(max_examples=60)
@given(steps=st.lists(ops, max_size=25), max_bytes=st.integers(300, 3000))
def test_the_store_behaves_like_an_lru_of_entries_under_a_byte_cap(
        steps: list[tuple[str, object]], max_bytes: int) -> None:
    """Contents, LRU order, byte accounting and the files on disk always match the model."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        store = CacheFileStore(directory, max_bytes=max_bytes, identity=IDENTITY)
        store.scan()
        # The model: key -> (entry, file bytes), least recently used first.
        model: collections.OrderedDict[str, tuple[HostEntry, int]] = collections.OrderedDict()
        for op, arg in steps:
            if op == "write":
                assert isinstance(arg, HostEntry)
                key = IDENTITY.key(arg.tokens)
                info = store.write(arg)
                if key in model:
                    model.move_to_end(key)
                    assert info is not None and info.file_bytes == model[key][1]
                elif info is None:  # only when the file alone would exceed the cap
                    with tempfile.TemporaryDirectory() as scratch:
                        unbounded = CacheFileStore(scratch, max_bytes=2**40, identity=IDENTITY)
                        assert unbounded.write(arg).file_bytes > max_bytes
                else:
                    assert info.file_bytes <= max_bytes
                    while sum(size for _, size in model.values()) + info.file_bytes > max_bytes:
                        model.popitem(last=False)
                    model[key] = (arg, info.file_bytes)
            elif op == "read":
                key = IDENTITY.key(arg)
                got = store.read(key)
                if key in model:
                    assert got is not None and same_entry(got, model[key][0])
                    model.move_to_end(key)
                else:
                    assert got is None
            elif op == "remove":
                key = IDENTITY.key(arg)
                store.remove(key)
                model.pop(key, None)
            elif op == "prefix":
                assert isinstance(arg, tuple)
                best = store.longest_prefix(arg)
                stored = [e.tokens for e, _ in model.values() if arg[: len(e.tokens)] == e.tokens]
                assert (best.tokens if best else None) == (max(stored, key=len) if stored else None)
            else:
                store = CacheFileStore(directory, max_bytes=max_bytes, identity=IDENTITY)
                store.scan()
                # File times are too coarse to order writes made microseconds apart: after a
                # restart the store's order is the truth, the contents must still match.
                assert {i.key for i in store.entries} == set(model)
                model = collections.OrderedDict((i.key, model[i.key]) for i in store.entries)
            assert [i.key for i in store.entries] == list(model)
            assert store.nbytes == sum(size for _, size in model.values()) <= max_bytes
            on_disk = {p.name: p.stat().st_size for p in directory.iterdir()}
            assert on_disk == {f"{key}{SUFFIX}": size for key, (_, size) in model.items()}
