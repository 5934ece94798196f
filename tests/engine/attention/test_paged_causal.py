"""The causal path for a lone row's chunk: its keys gathered to exactly its length, SDPA with mask="causal".

engine/attention/paged_attention.py `causal_row`: it must give what the reference
(a boolean mask over the row's whole table) gives, whole or in pieces of queries,
for any length, chunk, block size and transient limit, and ignore whatever lies
past the row's keys; the step must route a lone row's chunk to it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from mlx_trio.engine.attention.paged_attention import causal_row
from mlx_trio.engine.attention.paged_reference import reference_paged_attention
from mlx_trio.engine.kv.blocks.row import PagedRow
from mlx_trio.engine.kv.blocks.step import build_groups
from tests.engine.attention.test_paged_reference import _case


def _slots(table: mx.array, length: int, block_size: int) -> mx.array:
    positions = np.arange(length)
    return mx.array(np.array(table)[0, positions // block_size] * block_size + positions % block_size)


@given(length=st.integers(2, 90), L=st.integers(2, 40), block_size=st.sampled_from([1, 4, 16, 32]),
       gqa=st.sampled_from([(4, 2), (4, 4), (6, 1)]), limit=st.sampled_from([None, 1, 3000, 20000, 1 << 30]),
       seed=st.integers(0, 2**31))
def test_the_causal_path_equals_the_reference(length, L, block_size, gqa, limit, seed) -> None:
    L = min(L, length)  # the chunk is the row's last L positions, after its cached prefix
    heads, kv_heads = gqa
    q, pool_k, pool_v, table, _ = _case([length], L, block_size, heads, kv_heads, seed)
    want = reference_paged_attention(q, pool_k, pool_v, table, mx.array([length]), 0.3)
    got = causal_row(q, pool_k, pool_v, _slots(table, length, block_size), 0.3, limit=limit)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), (length, L, block_size, limit)


def test_the_causal_path_reads_no_key_past_the_rows_length() -> None:
    q, pool_k, pool_v, table, _ = _case([21], 5, 8, 4, 2, 1)
    want = causal_row(q, pool_k, pool_v, _slots(table, 21, 8), 0.3)
    k, v = np.array(pool_k), np.array(pool_v)
    t = np.array(table)
    for p in range(21, t.shape[1] * 8):
        k[t[0, p // 8], p % 8] = v[t[0, p // 8], p % 8] = 1e30
    got = causal_row(q, mx.array(k), mx.array(v), _slots(table, 21, 8), 0.3)
    assert mx.array_equal(got, want).item()


def test_a_lone_rows_chunk_gets_its_keys_slots_and_a_batchs_rows_of_one_width_keep_the_reference() -> None:
    row = PagedRow(tokens=list(range(40)), blocks=[7, 3, 9], length=20)
    (group,), _ = build_groups([row], 12, 16)
    assert group.key_lengths == (32,)
    assert np.array(group.key_slots).tolist() == [7 * 16 + p for p in range(16)] + [3 * 16 + p for p in range(16)]
    (group,), _ = build_groups([row], 12, 16, dummies=20)  # attended past its blocks: the table is widened
    assert group.key_lengths == (52,) and group.tables.shape == (1, 4)
    assert np.array(group.key_slots).tolist()[32:] == [7 * 16] * 20  # the dummies' keys: the row's first
    other = PagedRow(tokens=list(range(40)), blocks=[1, 2, 4], length=30)
    (group,), _ = build_groups([row, other], 2, 16)
    assert group.key_slots is None and group.key_lengths == (22, 32)
    (group,), _ = build_groups([row], 1, 16)  # a decode step keeps the kernel / the reference
    assert group.key_slots is None and group.visible is not None


def test_a_lone_rows_prefill_chunks_take_the_causal_path_and_keep_mlx_lms_tokens(monkeypatch) -> None:
    """Every layer of every prefill chunk of a paged row runs `causal_row` (token 0's L=1 step does not), and its
    greedy tokens are mlx-lm `generate_step`'s."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from mlx_trio.engine.attention import paged_attention, paged_layout, routed_attention
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.params import SamplingParams
    from mlx_trio.testing.tiny_models import LLAMA, tiny_model

    model = load(str(tiny_model(LLAMA)))[0]
    routed_attention.install(model)
    shapes = paged_layout.layer_shapes(model)
    kv = paged_layout.paged_kv_for(model, 64 * paged_layout.BlockStorage.block_bytes(shapes, 16, mx.float32), "t",
                                   block_size=16)
    calls = []
    original = paged_attention.causal_row

    def spy(q, *args, **kwargs):
        calls.append(q.shape[2])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(paged_attention, "causal_row", spy)
    prompt = [(7 * j + j * j) % 500 + 3 for j in range(150)]
    row = SoloRow(model, "r", prompt, SamplingParams(max_tokens=1), paged=kv, prefill_step_size=64)
    while row.prefill_chunk():
        pass
    assert calls == [64] * len(shapes) + [64] * len(shapes) + [21] * len(shapes)
    token0 = row.first_token()
    assert len(calls) == 3 * len(shapes)
    plain = load(str(tiny_model(LLAMA)))[0]
    want, _ = next(generate_step(mx.array(prompt), plain, prefill_step_size=64))
    assert token0 == int(want)
    row.close()
    assert kv.pool.idle
