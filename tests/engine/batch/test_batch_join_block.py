"""Cohort rows joining from their cohort's cache (engine/kv/row_blocks.py) decode the tokens of row-by-row joins.

Every path a block takes: into an empty batch, after a solo row, into free
slots of a running batch, a subset of a cohort (a row finished at token 0),
and the rows of two cohorts in one settle. The reference is the same rows
joined by their own caches (`block` cleared): the tokens must be equal.
"""

from __future__ import annotations

import pytest
from mlx_lm import load

from mlx_trio.engine.batch.cohort_prefill import prefill_rows
from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv import row_blocks
from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.engine.batch.batch_driver import token_ids

LENGTHS = {"a": 30, "b": 7, "c": 19, "d": 41, "e": 12, "f": 3}
STEPS = 10


@pytest.fixture(scope="module")
def model():
    return load(str(tiny_model(LLAMA)))[0]


def _prompt(rid: str) -> list[int]:
    return [(11 * ord(rid) + 5 * j) % 509 + 3 for j in range(LENGTHS[rid])]


def _cohort(model, rids: str) -> list[SoloRow]:
    rows = prefill_rows(model, [lambda rid=rid: SoloRow(model, rid, _prompt(rid), SamplingParams(max_tokens=64))
                                for rid in rids])
    assert all(isinstance(row, SoloRow) and row.block is not None for row in rows)
    return rows  # type: ignore[return-value]


def _solo(model, rid: str) -> SoloRow:
    row = SoloRow(model, rid, _prompt(rid), SamplingParams(max_tokens=64))
    while row.prefill_remaining:
        row.prefill_chunk()
    row.first_token()
    return row


def _decode(batch: DecodeBatch, out: dict[str, list[int]], steps: int = STEPS) -> None:
    for _ in range(steps):
        ids = list(batch.request_ids)
        tokens = token_ids(batch.step_decoded())
        if tokens:
            for rid, token in zip(ids, tokens):
                out.setdefault(rid, []).append(token)
    ids = list(batch.request_ids)
    for rid, token in zip(ids, token_ids(batch.flush_decoded()) or []):
        out.setdefault(rid, []).append(token)


def _keep_block(row: SoloRow, keep: bool) -> None:
    """Leave the row's block, or cut its own caches out of the cohort's and clear it (it joins by its own)."""
    if not keep and row.block is not None:
        _ = row.caches  # its own slices of the cohort's cache, cut now
        row.block = None


def _run(model, *, blocks: bool, running: str, settles: list[str], skip: str = "") -> dict[str, list[int]]:
    """`running` rows first (alone when one: solo), decoded; then each settle's cohort joins at once (less the rows
    in `skip`, as if they finished at token 0), decoded after each. `blocks=False` clears every row's block."""
    batch = DecodeBatch(model)
    out: dict[str, list[int]] = {}
    if running:
        first = [_solo(model, rid) for rid in running] if len(running) == 1 else _cohort(model, running)
        for row in first:
            _keep_block(row, blocks)
        batch.join_many([(row, row.token0) for row in first])
        _decode(batch, out)
    for settle in settles:
        rows = [row for group in settle.split("+") for row in _cohort(model, group)]
        joiners = [(row, row.token0) for row in rows if row.request_id not in skip]
        for row, _ in joiners:
            _keep_block(row, blocks)
        batch.join_many(joiners)
        _decode(batch, out)
    return out


@pytest.mark.parametrize(("running", "settles", "skip"), [
    ("", ["abcd"], ""),  # into an empty batch: the block is the batch
    ("a", ["bcd"], ""),  # after a solo row
    ("ab", ["cde"], ""),  # into the free slots of a running batch
    ("ab", ["cdef"], "d"),  # a cohort's subset (d finished at token 0)
    ("a", ["bc+de"], ""),  # two cohorts' rows in one settle: a run each
    ("ab", ["cd", "ef"], ""),  # two settles
])
def test_block_joins_decode_the_tokens_of_row_by_row_joins(model, running: str, settles: list[str], skip: str) -> None:
    got = _run(model, blocks=True, running=running, settles=settles, skip=skip)
    want = _run(model, blocks=False, running=running, settles=settles, skip=skip)
    assert got == want
    assert set(got) == set(running + "".join(settles).replace("+", "")) - set(skip)


def test_a_cohort_join_copies_out_of_the_cohort_cache_once_a_layer(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block path is the one taken: rows' own slices are not read, the cohort's cache is, once per layer."""
    taken: list[list[int]] = []
    real = row_blocks.take_rows
    monkeypatch.setattr(row_blocks, "take_rows", lambda layer, index: (taken.append(list(index)), real(layer, index))[1])
    rows = _cohort(model, "bcd")
    batch = DecodeBatch(model)
    batch.join_many([(row, row.token0) for row in rows])
    assert taken == [[0, 1, 2]] * len(model.layers)
    assert all(row.block is None and row.caches == [] for row in rows)


@pytest.mark.parametrize(("running", "cohort"), [("", "abcd"), ("a", "bcd"), ("ab", "cde")])
def test_rows_that_join_from_their_block_never_cut_their_own_slices(model, running: str, cohort: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A cohort hands its rows back as places in its cache (`SoloRow.take_block`); joining from the block cuts no
    row's own slices (an operation per row per layer), whatever the batch held."""
    batch = DecodeBatch(model)
    if running:
        first = [_solo(model, running)] if len(running) == 1 else _cohort(model, running)
        batch.join_many([(row, row.token0) for row in first])
        _decode(batch, {}, steps=2)
    monkeypatch.setattr(HostPaddedBatchKVCache, "extract", lambda self, idx: pytest.fail("a row's slices were cut"))
    rows = _cohort(model, cohort)
    assert all(row.holds_kv for row in rows)
    batch.join_many([(row, row.token0) for row in rows])
    assert sorted(batch.request_ids) == sorted(running + cohort)
