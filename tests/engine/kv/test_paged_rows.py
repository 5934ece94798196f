"""Block tables under random joins, prefix sharing, catch-up, forwards, truncation and leaves, without a model.

Each position's K/V is a stand-in that depends on the whole prefix up to it (as a model's does): a
row's KV is right when every position holds the value of its own prefix. After every operation each
live row reads back exactly its own prefix's values (so no write ever landed in a block another row
reads), the pool's states partition its blocks, and at the end the pool is idle.
"""

from __future__ import annotations

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.engine.kv.blocks.pool import PoolExhausted
from mlx_trio.engine.kv.blocks.row import PagedRow
from mlx_trio.engine.kv.blocks.storage import BlockStorage, LayerShape


def _value(prefix: list[int]) -> float:
    return float(hash(tuple(prefix)) % 100_003)


def _feed(kv: PagedKV, rows: list[PagedRow], tokens: list[list[int]]) -> None:
    """A forward's writes: each new position's value from its row's known prefix, then commit."""
    step = kv.step(rows, len(tokens[0]))
    values = [[_value(row.tokens[: row.length] + t[: i + 1]) for i in range(len(t))] for row, t in zip(rows, tokens)]
    block = mx.array(values, dtype=mx.float32)[:, None, :, None]  # [B, 1 head, L, 1]
    kv.storage.write(0, step.slots, block, block)
    kv.commit(step, tokens)


def _check(kv: PagedKV, rows: list[PagedRow]) -> None:
    kv.pool.check()
    for row in rows:
        if row.length:
            got = kv.extract(row)[0].keys[0, 0, :, 0].tolist()
            assert got == [_value(row.tokens[: p + 1]) for p in range(row.length)]


OPS = st.lists(st.tuples(st.sampled_from(["join", "join", "chunk", "decode", "decode", "truncate", "leave"]),
                         st.integers(0, 50), st.integers(0, 7)), min_size=8, max_size=40)


@settings(max_examples=200)
@given(ops=OPS, block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.sampled_from([6, 40]))
def test_random_row_operations_keep_every_rows_kv_and_leak_no_block(ops, block_size, num_blocks) -> None:
    kv = PagedKV(BlockStorage([LayerShape(1, 1)], num_blocks, block_size, mx.float32), "stand-in")
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]
    live: list[PagedRow] = []
    pending: dict[int, list[int]] = {}  # a joined row's prompt still to prefill
    for op, a, b in ops:
        try:
            if op == "join":
                prompt = prefixes[a % 3][: 4 + a % 9] + [20 + b] * (b % 3)
                row = kv.join(prompt)
                assert row.length <= len(prompt) - 1 and row.length % block_size == 0
                live.append(row)
                pending[id(row)] = prompt
                if b % 2 and row.length < len(prompt) - 1:  # prefilled at once (else chunk by chunk below)
                    _feed(kv, [row], [prompt[row.length : len(prompt) - 1]])
            elif op == "chunk" and live:  # a prefill chunk, after taking what siblings cached
                row = live[a % len(live)]
                prompt = pending.get(id(row), [])
                kv.catch_up(row)
                rest = prompt[row.length : len(prompt) - 1][: 1 + b]
                if rest and row.tokens[: row.length] == prompt[: row.length]:
                    _feed(kv, [row], [rest])
            elif op == "decode" and live:
                rows = live[: 1 + a % len(live)]
                for row in rows:  # decode feeds known tokens only: drop what a prefill had not fed yet
                    del row.tokens[row.length :]
                    pending.pop(id(row), None)
                _feed(kv, rows, [[30 + b]] * len(rows))
            elif op == "truncate" and live:
                row = live[a % len(live)]
                kv.truncate(row, min(row.length, b))
                pending.pop(id(row), None)
            elif op == "leave" and live:
                kv.leave(live.pop(a % len(live)))
        except PoolExhausted:
            pass  # a full pool refuses the whole step; nothing changed
        _check(kv, live)
    for row in live:
        kv.leave(row)
    kv.pool.check()
    assert kv.pool.idle
