"""BatchQuantizedKVCache: every row's quantized KV survives merge, extend, filter, steps and extract unchanged."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlx_trio.engine.kv import batch_caches, batch_kv
from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.kv.quantized_batch_kv import BatchQuantizedKVCache

HEADS, DIM, GROUP, BITS = 2, 64, 32, 4
SCHEME = KvScheme(bits=BITS, group_size=GROUP, start=0)


def _kv(length: int, salt: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, HEADS, length, DIM), key=mx.random.key(salt)).astype(mx.bfloat16)
    return k, -k


def _row(length: int, salt: int) -> tuple[KVCache, QuantizedKVCache]:
    """The same tokens in a bf16 and a quantized serial cache."""
    plain, quant = KVCache(), QuantizedKVCache(group_size=GROUP, bits=BITS)
    plain.update_and_fetch(*_kv(length, salt))
    quant.update_and_fetch(*_kv(length, salt))
    return plain, quant


def _same(a: QuantizedKVCache, b: QuantizedKVCache) -> None:
    assert a.offset == b.offset and (a.group_size, a.bits) == (b.group_size, b.bits)
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True):
        np.testing.assert_array_equal(np.array(x[..., : a.offset, :].astype(mx.float32)),
                                      np.array(y[..., : b.offset, :].astype(mx.float32)))


# ("join", lengths) | ("leave", seed) | ("step", count): what a decode batch does to a layer.
_ops = st.lists(st.one_of(
    st.tuples(st.just("join"), st.lists(st.integers(1, 9), min_size=1, max_size=3)),
    st.tuples(st.just("leave"), st.integers(0, 2**16)),
    st.tuples(st.just("step"), st.integers(1, 3)),
), max_size=8)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=4), _ops, st.booleans())
def test_rows_equal_their_serial_quantized_caches_through_joins_leaves_and_steps(first, ops, via_bf16) -> None:
    """Each extracted row == a serial QuantizedKVCache fed the same tokens; host padding == the array's.

    `via_bf16`: the batch starts as bf16 rows and converts (as a batch crossing the start does).
    """
    salt = 0
    solos: list[QuantizedKVCache] = []
    rows = []
    for n in first:
        plain, quant = _row(n, salt := salt + 1)
        rows.append(plain if via_bf16 else quant)
        solos.append(quant)
    layer = batch_caches.merge_rows(rows)
    if via_bf16:
        caches = [layer]
        SCHEME.convert_all(caches)
        layer = caches[0]
    assert isinstance(layer, BatchQuantizedKVCache)
    for op, arg in ops:
        if op == "join":
            new = [_row(n, salt := salt + 1)[1] for n in arg]
            layer = batch_caches.join_layer(layer, new, running_is_solo=False)
            solos += new
        elif op == "leave" and len(solos) > 1:
            keep = sorted(np.random.default_rng(arg).choice(len(solos), size=len(solos) - 1, replace=False).tolist())
            batch_caches.filter_layer(layer, keep)
            solos = [solos[i] for i in keep]
        elif op == "step":
            for _ in range(arg):
                k = mx.random.normal((len(solos), HEADS, 1, DIM), key=mx.random.key(salt := salt + 1)).astype(mx.bfloat16)
                layer.update_and_fetch(k, k * 2)
                for i, solo in enumerate(solos):
                    solo.update_and_fetch(k[i : i + 1], k[i : i + 1] * 2)
        batch_kv.share_offsets([layer])
        assert layer.host_padding == tuple(layer.left_padding.tolist())
        assert layer.offset.tolist() == [s.offset for s in solos]
    for i, solo in enumerate(solos):
        _same(layer.extract(i), solo)
    assert layer.nbytes == sum(x.nbytes for x in (*layer.keys, *layer.values))


def test_an_unpadded_step_gets_no_mask_and_attention_takes_the_quantized_path() -> None:
    """As for bf16 rows (engine/kv/batch_kv.py), and `bits` is what mlx-lm's attention dispatches on."""
    layer = batch_caches.merge_rows([_row(5, 1)[1], _row(5, 2)[1]])
    assert layer.make_mask(1) is None and (layer.bits, layer.group_size) == (BITS, GROUP)
    padded = batch_caches.merge_rows([_row(5, 1)[1], _row(3, 2)[1]])
    assert padded.make_mask(1).tolist()[1][0][0] == [False, False, True, True, True, True]  # + the new token


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 4), st.data())
def test_a_per_row_rollback_leaves_each_row_its_serial_cache_trimmed(lengths, written, data) -> None:
    """Speculation's rollback (engine/kv/row_rollback.py) on quantized rows: a verify writes `written` positions
    to every row, row b drops `rejected[b]` of them; each extracted row == its serial cache fed only the rest."""
    from mlx_trio.engine.kv import row_rollback

    salt = 0
    solos, rows = [], []
    for n in lengths:
        _, quant = _row(n, salt := salt + 1)
        rows.append(quant)
        solos.append(quant)
    batch = BatchQuantizedKVCache.merge(rows)  # copies: the serial caches stay as they are
    assert row_rollback.supports_rollback([batch]) and row_rollback.supports_rollback(rows)
    fresh = [_kv(written, 100 + b) for b in range(len(rows))]
    batch.update_and_fetch(mx.concatenate([k for k, _ in fresh]), mx.concatenate([v for _, v in fresh]))
    rejected = data.draw(st.lists(st.integers(0, written), min_size=len(rows), max_size=len(rows)))
    row_rollback.roll_back_rows([batch], rejected)
    for b, (solo, (k, v), r) in enumerate(zip(solos, fresh, rejected, strict=True)):
        kept = written - r
        if kept:
            solo.update_and_fetch(k[..., :kept, :], v[..., :kept, :])
        _same(batch.extract(b), solo)
        assert batch.host_padding[b] == batch.left_padding.tolist()[b]
