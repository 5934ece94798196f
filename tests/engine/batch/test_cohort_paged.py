"""A cohort under --kv-layout paged (engine/batch/cohort_prefill.py `prefill_rows_into`): its rows prefill on their
own caches and are copied into fresh blocks in the same job, holding exactly a solo prefill's KV and token 0, their
full blocks keyed for later rows; an error closes the rows it touched and leaves no block held."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from mlx_trio.engine.attention import paged_layout, routed_attention
from mlx_trio.engine.batch.cohort_prefill import prefill_rows_into
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

GREEDY = SamplingParams(max_tokens=8)
BLOCK = 8
PROMPTS = [[(13 * i + 7 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 17, 24, 9, 31])]


@pytest.fixture(scope="module")
def model():
    model = load(str(tiny_model(LLAMA)))[0]
    routed_attention.install(model)  # as at load: a pool needs the routed attention (on the CPU, mlx-lm's own)
    return model


def _kv(model) -> PagedKV:
    budget = 256 * paged_layout.BlockStorage.block_bytes(paged_layout.layer_shapes(model), BLOCK, mx.float32)
    return paged_layout.paged_kv_for(model, budget, "tiny-llama", block_size=BLOCK)


def _solo(model, i: int) -> SoloRow:
    row = SoloRow(model, f"s{i}", PROMPTS[i], GREEDY)
    while row.prefill_remaining:
        row.prefill_chunk()
    row.first_token()
    return row


def _makers(model):
    return [lambda i=i: SoloRow(model, f"r{i}", PROMPTS[i], GREEDY) for i in range(len(PROMPTS))]


def _own(cache) -> list[np.ndarray]:
    return [np.array(a[..., : cache.offset, :]) for a in (cache.keys, cache.values)]


def test_a_paged_cohort_row_holds_its_solo_prefill_in_fresh_keyed_blocks(model) -> None:
    kv = _kv(model)
    rows = prefill_rows_into(kv, model, _makers(model))
    assert all(isinstance(row, SoloRow) for row in rows)
    for i, row in enumerate(rows):
        solo = _solo(model, i)
        assert row.paged_kv is kv and row.paged_row is not None and row.block is None
        assert (row.token0, row.paged_row.length) == (solo.token0, len(PROMPTS[i]))
        for got, want in zip(kv.extract(row.paged_row), solo.caches, strict=True):
            for g, w in zip(_own(got), _own(want), strict=True):
                np.testing.assert_allclose(g, w, atol=1e-4)
    assert kv.stats().used == sum(-(-len(p) // BLOCK) for p in PROMPTS)
    # Their full blocks are keyed: a later row of the longest prompt references them instead of computing them.
    later = kv.join(PROMPTS[-1])
    assert later.length == (len(PROMPTS[-1]) - 1) // BLOCK * BLOCK
    kv.leave(later)
    for row in rows:
        row.close()
    assert kv.stats().used == 0


def test_a_row_that_cannot_be_adopted_fails_alone_and_its_blocks_are_free(model, monkeypatch) -> None:
    kv = _kv(model)
    adopt = SoloRow.adopt_into

    def fails_for_r2(row: SoloRow, paged: PagedKV) -> None:
        if row.request_id == "r2":
            raise RuntimeError("no blocks for r2")
        adopt(row, paged)

    monkeypatch.setattr(SoloRow, "adopt_into", fails_for_r2)
    rows = prefill_rows_into(kv, model, _makers(model))
    assert isinstance(rows[2], RuntimeError)
    assert [row.token0 for row in rows if isinstance(row, SoloRow)] == [_solo(model, i).token0 for i in (0, 1, 3, 4)]
    for row in rows:
        if isinstance(row, SoloRow):
            row.close()
    assert kv.stats().used == 0


class _Stop(BaseException):
    pass


def test_a_job_stopped_while_adopting_closes_every_row_it_made(model, monkeypatch) -> None:
    """Nobody else holds the rows of a job that raised: their blocks must go back there, or they leak."""
    kv = _kv(model)
    adopt = SoloRow.adopt_into

    def stops_at_r3(row: SoloRow, paged: PagedKV) -> None:
        if row.request_id == "r3":
            raise _Stop
        adopt(row, paged)

    monkeypatch.setattr(SoloRow, "adopt_into", stops_at_r3)
    with pytest.raises(_Stop):
        prefill_rows_into(kv, model, _makers(model))
    assert kv.stats().used == 0
