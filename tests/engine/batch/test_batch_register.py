"""DecodeBatch's contract: the pipelined register, ownership of caches, errors that leave it unchanged."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from mlx_lm import load
from mlx_lm.models.cache import ChunkedKVCache

from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, TinyModelSpec, tiny_model
from tests.engine.batch.batch_driver import token_ids


@cache
def _model(spec: TinyModelSpec = LLAMA) -> Any:
    return load(str(tiny_model(spec)))[0]


def _ready_row(request_id: str, n: int, *, spec: TinyModelSpec = LLAMA, **params: Any) -> SoloRow:
    row = SoloRow(_model(spec), request_id, [(7 * n + 3 * j) % 500 + 3 for j in range(n)],
                  SamplingParams(**params), prefill_step_size=4)
    while row.prefill_chunk():
        pass
    row.first_token()
    return row


def _batch(*rows: SoloRow, spec: TinyModelSpec = LLAMA) -> DecodeBatch:
    batch = DecodeBatch(_model(spec))
    for row in rows:
        assert row.token0 is not None
        batch.join_many([(row, row.token0)])
    return batch


def test_step_returns_the_previous_step_and_flush_the_queued_one() -> None:
    """After a join the first step returns None (token 0 was already returned); flush drains once."""
    batch = _batch(_ready_row("a", 5), _ready_row("b", 9))
    assert batch.is_flushed and batch.request_ids == ["a", "b"]
    assert token_ids(batch.step_decoded()) is None and not batch.is_flushed
    first = token_ids(batch.step_decoded())
    assert first is not None and len(first) == 2
    queued = token_ids(batch.flush_decoded())
    assert queued is not None and len(queued) == 2 and batch.is_flushed
    assert token_ids(batch.flush_decoded()) is None
    assert token_ids(batch.step_decoded()) is None  # the flushed tokens are this step's inputs, already returned
    assert batch.num_fed("a") == 5 + 3 and batch.num_fed("b") == 9 + 3  # three forwards


def test_leave_unflushed_equals_leave_flushed() -> None:
    """Dropping a row with a step in flight (mlx-lm's way) leaves the survivors' tokens unchanged."""
    results = []
    for flush_first in (False, True):
        batch = _batch(_ready_row("a", 5), _ready_row("b", 9), _ready_row("c", 14))
        tokens: dict[str, list[int]] = {"a": [], "c": []}
        batch.step_decoded()
        batch.step_decoded()
        if flush_first:
            for rid, t in zip(batch.request_ids, token_ids(batch.flush_decoded()) or []):
                tokens.setdefault(rid, []).append(t)
        batch.leave(["b"])
        for _ in range(6):
            for rid, t in zip(batch.request_ids, token_ids(batch.step_decoded()) or []):
                tokens[rid].append(t)
        for rid, t in zip(batch.request_ids, token_ids(batch.flush_decoded()) or []):
            tokens[rid].append(t)
        results.append({rid: toks[-5:] for rid, toks in tokens.items() if rid != "b"})
    assert results[0] == results[1]


def test_join_takes_the_rows_caches_and_kv_bytes_return_to_zero() -> None:
    """A joined SoloRow holds no bytes; the batch's nbytes falls to 0 when every row has left."""
    a, b = _ready_row("a", 6), _ready_row("b", 30)
    solo_bytes = a.nbytes
    batch = _batch(a)
    assert a.nbytes == 0 and batch.nbytes == solo_bytes and batch.is_solo
    batch.join_many([(b, b.token0 or 0)])
    assert b.nbytes == 0 and batch.nbytes > 0 and not batch.is_solo
    batch.step_decoded()
    batch.leave(["a"])
    assert batch.is_solo and batch.request_ids == ["b"]  # extracted back to solo caches
    batch.step_decoded()
    batch.leave(["b"])
    assert batch.size == 0 and batch.nbytes == 0 and batch.is_flushed


def test_join_needs_a_flushed_batch_and_a_fresh_row() -> None:
    """join raises on a step in flight, a row before token 0 and a duplicate id, changing nothing."""
    batch = _batch(_ready_row("a", 5))
    batch.step_decoded()
    with pytest.raises(RuntimeError):
        batch.join_many([(_ready_row("b", 5), 0)])
    batch.flush_decoded()
    raw = SoloRow(_model(), "c", [4, 5, 6], SamplingParams())
    with pytest.raises(RuntimeError):
        batch.join_many([(raw, 0)])
    with pytest.raises(ValueError):
        batch.join_many([(_ready_row("a", 7), 0)])
    assert batch.request_ids == ["a"] and batch.is_solo


def test_leave_unknown_id_raises_and_changes_nothing() -> None:
    """An id not in the batch raises KeyError before any row is dropped."""
    batch = _batch(_ready_row("a", 5), _ready_row("b", 6))
    with pytest.raises(KeyError):
        batch.leave(["a", "zzz"])
    assert batch.request_ids == ["a", "b"]


def test_join_of_unbatchable_caches_raises_type_error() -> None:
    """A layer without merge (llama4's chunked KV) cannot join a running batch; the batch is unchanged."""
    batch = _batch(_ready_row("a", 5))
    row = _ready_row("q", 5)
    row.caches = [ChunkedKVCache(chunk_size=64) for _ in row.caches]
    with pytest.raises(TypeError):
        batch.join_many([(row, row.token0 or 0)])
    assert batch.request_ids == ["a"] and batch.is_solo


@pytest.mark.parametrize("spec", [LLAMA, LLAMA_SWA], ids=["full", "rotating"])
def test_a_batched_rows_cache_entry_is_a_copy_of_the_fed_tokens(spec: TinyModelSpec) -> None:
    """cache_entry of a batched row copies its KV (num_fed tokens); later steps never change the copy."""
    for rows in (("a", "b"),):
        batch = _batch(*(_ready_row(r, 20 + i, spec=spec) for i, r in enumerate(rows)), spec=spec)
        batch.step_decoded()
        batch.flush_decoded()
        entry = batch.cache_entry("a", tuple(range(batch.num_fed("a"))))
        assert entry is not None
        snapshot = entry.caches
        offsets = [c.offset for c in snapshot]
        keys = [c.keys[..., : c.offset, :] * 1 for c in snapshot if spec.sliding_window is None]
        assert all(o == batch.num_fed("a") for o in offsets)
        for _ in range(3):
            batch.step_decoded()
        batch.flush_decoded()
        assert [c.offset for c in snapshot] == offsets
        for c, k in zip((c for c in snapshot if spec.sliding_window is None), keys):
            assert (c.keys[..., : c.offset, :] == k).all().item()
        batch.close()


def test_reported_steps_hand_over_the_same_tokens_in_the_same_order() -> None:
    """With `report`, a job's tokens go to the callback in one call (none are returned), the same as returned without."""
    def run(report: Any) -> tuple[list[Any], DecodeBatch]:
        batch = _batch(_ready_row("a", 5), _ready_row("b", 9), _ready_row("c", 3, temperature=0.7, seed=3))
        returned = batch.steps_decoded(6, report)
        return returned, batch

    plain, plain_batch = run(None)
    seen: list[Any] = []
    reported, reported_batch = run(seen.append)
    assert reported == [None] * 6
    assert seen == [[d for d in plain if d is not None]]  # one call; 5 steps: the first's previous was token 0
    assert reported_batch.flush_decoded() == plain_batch.flush_decoded()
    assert reported_batch.num_fed("a") == plain_batch.num_fed("a") == 5 + 6


def test_a_reported_one_step_job_right_after_a_join_reports_nothing() -> None:
    batch = _batch(_ready_row("a", 5))
    seen: list[Any] = []
    assert batch.steps_decoded(1, seen.append) == [None] and seen == []
    assert batch.steps_decoded(1, seen.append) == [None] and len(seen) == 1 and len(seen[0]) == 1


@pytest.mark.parametrize(("wait_s", "expected"), [(1e9, ["report", "launch"]), (-1.0, ["launch", "report"])],
                         ids=["host-bound", "device-bound"])
def test_a_reported_step_reads_before_its_launch_only_while_the_device_keeps_up(
        monkeypatch: pytest.MonkeyPatch, wait_s: float, expected: list[str]) -> None:
    """The last read's wait for the device picks the order; the tokens are the same either way."""
    import mlx.core as mx

    from mlx_trio.engine.batch import decode_batch as batch_module

    events: list[str] = []
    launch = mx.async_eval
    batch = _batch(_ready_row("a", 5), _ready_row("b", 9))
    plain = _batch(_ready_row("a", 5), _ready_row("b", 9))
    expected_tokens = [plain.step_decoded() for _ in range(3)][1:]
    monkeypatch.setattr(batch_module, "DEVICE_BOUND_WAIT_S", wait_s)
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: events.append("launch") or launch(*arrays))
    seen: list[Any] = []
    batch.step_decoded(seen.append)  # the first after a join reads nothing
    batch.step_decoded(seen.append)  # its read sets the mode
    events.clear()
    batch.step_decoded(lambda decoded: events.append("report") or seen.append(decoded))
    assert events == expected
    assert seen == expected_tokens
