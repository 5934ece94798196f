"""The block pool's bookkeeping: alloc / retain / release / register / evict never leak, and eviction is LRU and last."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_trio.engine.kv.blocks.chain import block_key, chain_keys, root_key
from mlx_trio.engine.kv.blocks.step import GROUP_WIDTH_RATIO, width_groups
from mlx_trio.engine.kv.blocks.pool import BlockPool, PoolExhausted

ROOT = root_key("tiny", "")


def _key(i: int) -> bytes:
    return block_key(ROOT, [i])


OPS = st.lists(st.tuples(st.sampled_from(["alloc", "retain", "release", "register", "lookup"]),
                         st.integers(0, 7), st.integers(0, 5)), max_size=80)


@given(num_blocks=st.integers(1, 12), ops=OPS)
def test_random_operations_keep_the_states_a_partition_and_return_to_idle(num_blocks: int, ops: list) -> None:
    pool = BlockPool(num_blocks)
    held: list[int] = []  # one entry per reference we hold
    for op, a, b in ops:
        if op == "alloc":
            if a > pool.available():
                with pytest.raises(PoolExhausted):
                    pool.allocate(a)
            else:
                got = pool.allocate(a)
                assert len(set(got)) == a and all(pool.refs(x) == 1 and pool.key_of(x) is None for x in got)
                held += got
        elif op == "retain" and held:
            block = held[a % len(held)]
            pool.retain(block)
            held.append(block)
        elif op == "release" and held:
            pool.release([held.pop(a % len(held))])
        elif op == "register" and held:
            block = held[a % len(held)]
            key = _key(b)
            owner = pool.lookup([key])
            ok = pool.register(block, key)
            assert ok == (owner == [block] or (not owner and pool.key_of(block) == key))
        elif op == "lookup":
            for block in pool.lookup([_key(b)]):
                pool.retain(block)
                held.append(block)
        pool.check()
        assert pool.stats().used == len(set(held))
    pool.release(held)
    pool.check()
    stats = pool.stats()
    assert pool.idle and stats.used == stats.shared == 0 and stats.free + stats.cached == num_blocks


def test_cached_blocks_are_evicted_only_when_the_free_list_is_empty_least_recently_released_first() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    for block, i in ((a, 0), (b, 1), (c, 2)):
        assert pool.register(block, _key(i))
    pool.release([b])
    pool.release([a])
    pool.release([c])  # cached in LRU order b, a, c; block 3 still free
    assert pool.stats().cached == 3 and pool.stats().free == 1
    assert pool.allocate(1) == [3]  # the free block first: nothing evicted
    assert pool.lookup([_key(0), _key(1), _key(2)]) == [a, b, c]
    pool.retain(a)  # a is read again: no longer evictable
    assert pool.allocate(1) == [b]  # the least recently released of the rest
    assert pool.lookup([_key(1)]) == [] and pool.key_of(b) is None
    assert pool.allocate(1) == [c]
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.release([a, b, c, 3])
    pool.check()
    assert pool.idle


def test_a_key_names_one_block_and_a_duplicate_stays_unkeyed_and_is_freed() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    assert pool.register(first, _key(0))
    assert not pool.register(second, _key(0))
    pool.release([first, second])
    assert pool.stats().cached == 1 and pool.stats().free == 1 and pool.lookup([_key(0)]) == [first]


def test_misuse_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.retain(0)  # free
    with pytest.raises(ValueError):
        pool.release([0])
    with pytest.raises(ValueError):
        BlockPool(0)


def test_chain_keys_name_the_whole_prefix_model_and_adapter() -> None:
    tokens = list(range(40))
    keys = chain_keys(ROOT, tokens, 8)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert chain_keys(ROOT, tokens[:17], 8) == keys[:2]  # a partial block has no key
    assert chain_keys(ROOT, [99] + tokens[1:], 8)[4] != keys[4]  # an earlier token changes every later key
    assert chain_keys(root_key("tiny", "lora-1"), tokens, 8)[0] != keys[0]
    assert chain_keys(root_key("other", ""), tokens, 8)[0] != keys[0]


@given(widths=st.lists(st.integers(1, 5000), min_size=1, max_size=64))
def test_width_groups_gather_at_most_twice_the_blocks_the_rows_hold(widths: list[int]) -> None:
    """The reference attention gathers each group at its widest row: never the batch's longest row for all."""
    groups = width_groups(widths)
    assert sorted(i for g in groups for i in g) == list(range(len(widths)))
    gathered = sum(len(g) * max(widths[i] for i in g) for g in groups)
    assert gathered <= GROUP_WIDTH_RATIO * sum(widths)
    assert len(groups) <= 1 + max(widths).bit_length()  # a handful of groups, not one a row
    if len(set(widths)) == 1:
        assert len(groups) == 1
