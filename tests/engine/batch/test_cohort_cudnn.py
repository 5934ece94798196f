"""Under prefill-only cuDNN a cohort of short prompts shares its forwards, on MLX's plain attention ops.

On the CPU the layout switch (engine/kv/decode_layout.py) is flipped by hand:
the routed attention then sends a `CohortKVCache`'s attention to
`unfused_attention`, which computes what MLX's own attention computes here, so
the cohort's rows must end exactly where the same cohort ends without the
switch, and like their solo prefills (as tests/engine/batch/test_cohort_prefill.py
checks those). Where the routed attention does not cover the model, for long
prompts or too many rows, the rows prefill alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from mlx_trio.engine.attention import routed_attention
from mlx_trio.engine.batch import cohort_prefill
from mlx_trio.engine.batch.cohort_prefill import can_prefill_together, prefill_rows
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.prompt_cache.ram_tier import CacheHit
from mlx_trio.engine.kv import decode_layout
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

GREEDY = SamplingParams(max_tokens=8)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, logprobs=True, top_logprobs=3)
LENGTHS = (7, 30, 2, 19)


def _prompt(salt: int, n: int) -> list[int]:
    return [(13 * salt + 7 * j) % 500 + 3 for j in range(n)]


@pytest.fixture(scope="module")
def routed():
    model = load(str(tiny_model(LLAMA)))[0]
    routed_attention.install(model)
    return model


@pytest.fixture
def cudnn_layout() -> Iterator[None]:
    decode_layout.set_active(True)
    try:
        yield
    finally:
        decode_layout.set_active(False)


def _solo_entry(model, n: int):
    """The prompt-cache entry of `_prompt(99, n)`'s KV (a solo prefill's snapshot)."""
    row = SoloRow(model, "s", [*_prompt(99, n), 9], GREEDY)
    while row.prefill_remaining:
        row.prefill_chunk()
    return row.snapshot()


def _makers(model, lengths=LENGTHS):
    return [lambda i=i, n=n: SoloRow(model, f"r{i}", _prompt(i, n), SEEDED if i == 1 else GREEDY)
            for i, n in enumerate(lengths)]


def _state(rows) -> list[tuple]:
    out = []
    for row in rows:
        kv = [np.array(a) for c in row.caches for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])]
        lp = row.token0_logprobs
        out.append((row.token0, row.fed, kv, None if lp is None else (lp.logprob, tuple(lp.top))))
    return out


def _same(a, b) -> bool:
    return all(x[0] == y[0] and x[1] == y[1] and x[3] == y[3] and all(np.array_equal(p, q) for p, q in zip(x[2], y[2]))
               for x, y in zip(a, b, strict=True))


def test_short_prompts_share_their_forwards_off_cudnn_and_end_as_without_it(routed, cudnn_layout, monkeypatch) -> None:
    calls = []
    plain = routed_attention.unfused_attention
    monkeypatch.setattr(routed_attention, "unfused_attention", lambda *a: calls.append(a[0].shape) or plain(*a))
    rows = [make() for make in _makers(routed)]
    assert can_prefill_together(rows, routed)
    for row in rows:
        row.close()
    got = _state(prefill_rows(routed, _makers(routed)))
    # Every layer of every shared forward routed: the rows' prompt tokens (rows leave as their prompts end),
    # then token 0's step of all the rows at once.
    layers = len(routed.layers)
    assert len(calls) % layers == 0 and calls[0][0] == len(LENGTHS) and calls[-1][:3] == (len(LENGTHS), 4, 1)
    decode_layout.set_active(False)
    want = _state(prefill_rows(routed, _makers(routed)))  # the same cohort on MLX's own attention
    assert _same(got, want)
    alone = _state(prefill_rows(routed, [make])[0] for make in _makers(routed))
    assert [g[0] for g in got] == [a[0] for a in alone]  # token 0 as each row's solo prefill
    for g, a in zip(got, alone, strict=True):
        for x, y in zip(g[2], a[2], strict=True):
            np.testing.assert_allclose(x, y, atol=1e-4)


def test_where_a_cohort_keeps_prefilling_row_after_row(routed, cudnn_layout) -> None:
    short = [make() for make in _makers(routed)]
    assert not can_prefill_together(short)  # no model: the route cannot be checked
    unrouted = load(str(tiny_model(LLAMA)))[0]
    assert not can_prefill_together([make() for make in _makers(unrouted)], unrouted)
    long = [make() for make in _makers(routed, (7, cohort_prefill.COHORT_CUDNN_MAX_CONTEXT + 1))]
    assert not can_prefill_together(long, routed)
    assert can_prefill_together(short, routed)
    for row in [*short, *long]:
        row.close()


def test_without_the_layout_the_route_stays_as_it_was(routed, monkeypatch) -> None:
    """Off prefill-only cuDNN (the CPU, Metal) a cohort's attention is MLX's own, as before."""
    calls = []
    monkeypatch.setattr(routed_attention, "unfused_attention", lambda *a: calls.append(1))
    outcomes = prefill_rows(routed, _makers(routed))
    assert all(isinstance(row, SoloRow) for row in outcomes) and not calls
    mx.clear_cache()


def test_more_rows_than_one_forward_takes_share_forwards_in_groups(routed, cudnn_layout, monkeypatch) -> None:
    monkeypatch.setattr(cohort_prefill, "COHORT_CUDNN_MAX_ROWS", 3)
    batches = []
    plain = routed_attention.unfused_attention
    monkeypatch.setattr(routed_attention, "unfused_attention", lambda *a: batches.append(a[0].shape[0]) or plain(*a))
    lengths = (5, 9, 4, 12, 6, 3, 8)
    got = prefill_rows(routed, _makers(routed, lengths))
    # Groups of 3, 3 and 1 rows, each with its token-0 step; 3 rows run as 4 (`cohort_shape`: an empty row).
    assert max(batches) == 4 and batches[-1] == 1
    alone = [prefill_rows(routed, [make])[0] for make in _makers(routed, lengths)]
    assert [r.token0 for r in got] == [r.token0 for r in alone]


def test_a_cohort_runs_at_bucketed_shapes_and_its_empty_rows_change_nothing(routed, cudnn_layout) -> None:
    """3 rows of up to 30 tokens run as 4 rows of 32 under the layout; they end exactly as without it (3 x 30)."""
    assert cohort_prefill.cohort_shape(3, 30) == (4, 32)
    assert [cohort_prefill.cohort_shape(n, 1) for n in (1, 2, 5, 17, 32)] == [(1, 32), (2, 32), (8, 32), (32, 32), (32, 32)]
    assert cohort_prefill.cohort_shape(2, 0) == (2, 0) and cohort_prefill.cohort_shape(1, 65) == (1, 96)
    lengths = (7, 30, 2)
    bucketed = _state(prefill_rows(routed, _makers(routed, lengths)))
    decode_layout.set_active(False)
    exact = _state(prefill_rows(routed, _makers(routed, lengths)))
    assert _same(bucketed, exact)


def test_a_forward_group_is_bounded_by_rows_padded_tokens_and_scores(routed, cudnn_layout, monkeypatch) -> None:
    """Under the layout each shared forward holds at most COHORT_CUDNN_MAX_ROWS rows, COHORT_CUDNN_MAX_TOKENS
    padded tokens (rows x its longest prompt) and COHORT_CUDNN_MAX_SCORES query-key pairs (rows x columns x
    keys, a cached prefix included); off it, one group."""
    monkeypatch.setattr(cohort_prefill, "COHORT_CUDNN_MAX_TOKENS", 100)
    monkeypatch.setattr(cohort_prefill, "COHORT_CUDNN_MAX_ROWS", 3)
    rows = [make() for make in _makers(routed, (31, 46, 21, 5, 5, 5, 5))]
    sizes = [[row.prefill_remaining for row in group] for group in cohort_prefill.forward_groups(rows)]
    assert sizes == [[30, 45], [20, 4, 4], [4, 4]]
    decode_layout.set_active(False)
    assert [len(group) for group in cohort_prefill.forward_groups(rows)] == [7]
    decode_layout.set_active(True)
    # Rows extending a 60-token cached prefix by 4 tokens each: 4 x 4 x 65 pairs fit 1100, a fifth row not.
    monkeypatch.setattr(cohort_prefill, "COHORT_CUDNN_MAX_ROWS", 32)
    monkeypatch.setattr(cohort_prefill, "COHORT_CUDNN_MAX_SCORES", 1100)
    entry = _solo_entry(routed, 60)
    hits = [SoloRow(routed, f"h{i}", [*_prompt(99, 60), *_prompt(i, 5)], GREEDY, hit=CacheHit(entry, 60))
            for i in range(5)]
    assert [row.fed for row in hits] == [60] * 5
    assert [len(group) for group in cohort_prefill.forward_groups(hits)] == [4, 1]


def test_longer_prompts_share_forwards_fed_in_column_chunks_and_match_their_solo_prefills(routed, cudnn_layout,
                                                                                         monkeypatch) -> None:
    """Prompts past the old 512-token bound share their forwards, fed COHORT_CUDNN_COLUMNS columns at a time
    (here 16): every row's token 0 and KV are its solo prefill's."""
    monkeypatch.setattr(cohort_prefill, "COHORT_CUDNN_COLUMNS", 16)
    batches = []
    plain = routed_attention.unfused_attention
    monkeypatch.setattr(routed_attention, "unfused_attention", lambda *a: batches.append(a[0].shape[:3]) or plain(*a))
    lengths = (600, 37, 90)
    got = prefill_rows(routed, _makers(routed, lengths))
    assert {shape[0] for shape in batches} == {3} and max(shape[2] for shape in batches) == 16
    decode_layout.set_active(False)
    alone = [prefill_rows(routed, [make])[0] for make in _makers(routed, lengths)]
    for row, solo in zip(got, alone, strict=True):
        assert (row.token0, row.fed) == (solo.token0, solo.fed)
        for a, b in zip(_state([row])[0][2], _state([solo])[0][2], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4)
