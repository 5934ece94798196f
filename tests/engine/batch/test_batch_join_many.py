"""Joining several rows in one `join_many` equals joining them one by one (full, rotating, hybrid)."""

from __future__ import annotations


import pytest
from mlx_lm import load

from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model

from mlx_trio.testing import batch_reference as ref
from tests.engine.batch.batch_driver import token_ids

LENGTHS = {"a": 30, "b": 7, "c": 19, "d": 41}


def _model(name: str):
    if name == "qwen3_next":
        return ref.tiny_qwen3_next(), 256
    return load(str(tiny_model({"llama": LLAMA, "llama_swa": LLAMA_SWA}[name])))[0], 512


def _row(model, rid: str, vocab: int) -> tuple[SoloRow, int]:
    prompt = [(11 * ord(rid) + 5 * j) % (vocab - 3) + 3 for j in range(LENGTHS[rid])]
    row = SoloRow(model, rid, prompt, SamplingParams(max_tokens=64))
    while row.prefill_remaining:
        row.prefill_chunk()
    return row, row.first_token()


def _run(model, vocab: int, *, together: bool) -> dict[str, list[int]]:
    batch = DecodeBatch(model)
    batch.join_many([_row(model, "a", vocab)])
    out: dict[str, list[int]] = {rid: [] for rid in LENGTHS}
    for _ in range(20):  # past the sliding window (16): the rotating layers have wrapped
        tokens = token_ids(batch.step_decoded())
        if tokens:
            out["a"].extend(tokens)
    out["a"].extend(token_ids(batch.flush_decoded()) or [])
    joiners = [_row(model, rid, vocab) for rid in ("b", "c", "d")]
    if together:
        batch.join_many(joiners)
    else:
        for row, token0 in joiners:
            batch.join_many([(row, token0)])
    for _ in range(12):
        tokens = token_ids(batch.step_decoded())
        if tokens:
            for rid, token in zip(batch.request_ids, tokens):
                out[rid].append(token)
    return out


@pytest.mark.parametrize("name", ["llama", "llama_swa", "qwen3_next"])
def test_join_many_gives_the_tokens_of_one_by_one_joins(name: str) -> None:
    model, vocab = _model(name)
    assert _run(model, vocab, together=True) == _run(model, vocab, together=False)


def test_join_many_into_an_empty_batch_merges_all_and_one_row_is_adopted() -> None:
    model, vocab = _model("llama")
    batch = DecodeBatch(model)
    batch.join_many([_row(model, "a", vocab)])
    assert batch.is_solo and batch.size == 1
    other = DecodeBatch(model)
    other.join_many([_row(model, "a", vocab), _row(model, "b", vocab)])
    assert not other.is_solo and other.request_ids == ["a", "b"]
    with pytest.raises(ValueError):
        other.join_many([_row(model, "a", vocab)])


def test_prefill_rows_isolates_a_failing_row_and_matches_solo_prefill() -> None:
    """A cohort job: each row is what it would be alone; one row's error takes its place only."""
    from mlx_trio.engine.batch.cohort_prefill import prefill_rows

    model, vocab = _model("llama")
    alone = _row(model, "c", vocab)[1]

    def broken() -> SoloRow:
        raise ValueError("bad row")

    prompt = [(11 * ord("c") + 5 * j) % (vocab - 3) + 3 for j in range(LENGTHS["c"])]
    rows = prefill_rows(model, [lambda: SoloRow(model, "x", prompt, SamplingParams(max_tokens=4)), broken,
                         lambda: SoloRow(model, "y", prompt, SamplingParams(max_tokens=4))])
    assert isinstance(rows[1], ValueError)
    assert [r.token0 for r in (rows[0], rows[2])] == [alone, alone]
