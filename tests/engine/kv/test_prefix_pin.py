"""Pinning a cached prefix for admission's credit (PagedKV.pin_prefix / join(pin=) / unpin), without a model.

Admission may reserve only the blocks a row will allocate if the cached prefix it credits cannot be evicted
before the row joins: these tests pin that, and that the credited count is what the rows really allocate.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.engine.kv.blocks.pool import PoolExhausted
from tests.engine.kv.test_paged_rows import _check, _feed

BS = 4


def _kv(num_blocks: int) -> PagedKV:
    from mlx_trio.engine.kv.blocks.storage import BlockStorage, LayerShape

    return PagedKV(BlockStorage([LayerShape(1, 1)], num_blocks, BS, mx.float32), "stand-in")


def _prefill(kv: PagedKV, prompt: list[int]) -> None:
    """One row prefills `prompt` and leaves: its full blocks stay cached."""
    row = kv.join(prompt)
    _feed(kv, [row], [prompt[row.length:]])
    kv.leave(row)


def test_a_pinned_prefix_survives_eviction_and_join_takes_it_over() -> None:
    kv = _kv(7)
    prefix = list(range(1, 13))  # 3 full blocks
    _prefill(kv, prefix + [99])
    pin = kv.pin_prefix(prefix + [50, 51])
    assert len(pin.blocks) == 3
    with pytest.raises(PoolExhausted):  # the pinned blocks are not evictable: only 4 are free
        kv.pool.allocate(5)
    other = kv.join([7] * 12)  # fills the free blocks; would have evicted an unpinned prefix
    _feed(kv, [other], [other.tokens])
    row = kv.join(prefix + [50, 51], pin=pin)
    assert row.blocks[:3] == pin.blocks and row.length == 12
    _feed(kv, [row], [row.tokens[row.length:]])
    _check(kv, [row, other])
    kv.leave(row), kv.leave(other)
    assert kv.pool.idle


def test_unpin_returns_the_pool_to_idle_and_a_pin_is_taken_once() -> None:
    kv = _kv(8)
    _prefill(kv, list(range(1, 10)))
    pin = kv.pin_prefix(list(range(1, 10)))
    assert not kv.pool.idle
    kv.unpin(pin), kv.unpin(pin)
    assert kv.pool.idle and kv.pool.stats().cached == 2
    with pytest.raises(ValueError):
        kv.join(list(range(1, 10)), pin=pin)
    kv.pool.check()


def test_credited_siblings_fit_where_the_conservative_count_refused_them() -> None:
    """8 siblings share a 32-token prefix (8 blocks), 3-token tails, 4 tokens to generate: 11 blocks each
    conservatively (88 > 24), but 3 own blocks each once the prefix is cached and pinned (8 + 8*3 = 32)."""
    kv = _kv(32)
    prefix = list(range(1, 33))
    _prefill(kv, prefix + [0])
    siblings = [prefix + [100 + i, 200 + i, 300 + i] for i in range(8)]
    conservative = sum(-(-(len(p) + 4) // BS) for p in siblings)
    assert conservative > kv.pool.num_blocks
    pins = [kv.pin_prefix(p) for p in siblings]
    shared = {b for pin in pins for b in pin.blocks}  # counted once, however many siblings credit them
    credited = len(shared) + sum(kv.blocks_to_allocate(len(p) + 4, pin) for p, pin in zip(siblings, pins))
    assert credited <= kv.pool.num_blocks
    rows = [kv.join(p, pin=pin) for p, pin in zip(siblings, pins)]
    _feed(kv, rows, [r.tokens[r.length:] for r in rows])  # the tails: no PoolExhausted
    for step in range(4):  # decode up to the credited length
        _feed(kv, rows, [[400 + step]] * len(rows))
    _check(kv, rows)
    assert kv.pool.stats().used <= credited
    for row in rows:
        kv.leave(row)
    assert kv.pool.idle


def test_a_pin_of_another_adapter_revision_is_refused_at_join_not_joined_over_its_reservation() -> None:
    """The pin and the join read an adapter's revision in two lease jobs; `Engine.load_adapter` keeps them equal.
    Were they ever not, the join must fail loudly: the pinned blocks hold another revision's KV, and a row
    looking its prefix up afresh would allocate the blocks admission credited."""
    kv = _kv(8)
    prompt = list(range(1, 10))
    for revision in ("a@1", "a@2"):
        row = kv.join(prompt, revision)
        _feed(kv, [row], [prompt[row.length:]])
        kv.leave(row)
    pin = kv.pin_prefix(prompt, "a@1")
    assert len(pin.blocks) == 2
    used = kv.pool.stats().used
    with pytest.raises(ValueError, match="another adapter revision.*'a@2'"):
        kv.join(prompt, "a@2", pin=pin)
    assert kv.pool.stats().used == used and not pin.taken  # nothing allocated or referenced by the refused join
    kv.unpin(pin)
    assert kv.pool.idle
    kv.pool.check()


def test_starts_cached_looks_the_first_block_up_under_the_rows_revision() -> None:
    kv = _kv(8)
    prompt = list(range(1, 10))
    row = kv.join(prompt, "a@1")
    _feed(kv, [row], [prompt[row.length:]])
    kv.leave(row)
    assert kv.starts_cached(prompt, "a@1")
    assert not kv.starts_cached(prompt) and not kv.starts_cached(prompt, "a@2") and not kv.starts_cached(prompt, "b@1")
