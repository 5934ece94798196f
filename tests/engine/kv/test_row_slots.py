"""Row slots (engine/kv/row_slots.py): joins into freed slots and leaves that move no row, token-exact.

The oracle is mlx-lm's own `generate_step` of each request alone (greedy,
float32 tiny llama on the CPU); the schedules are random join/leave orders
with rows leaving in the same settle as others join, as the decode-step
actor does it (flush, leave, join). The structural tests pin what the layout
promises: a leave moves no row, a join into a free slot copies no other
row, only a longer joiner re-lays the batch out.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv import row_slots
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model

PREFILL_STEP_SIZE = 8


@cache
def _model(spec_name: str = "llama") -> Any:
    return load(str(tiny_model({"llama": LLAMA, "llama_swa": LLAMA_SWA}[spec_name])))[0]


def _prompt(i: int, length: int) -> tuple[int, ...]:
    return tuple((37 * i + 11 * j + j * j) % 509 + 3 for j in range(length))


@cache
def _solo_tokens(spec_name: str, i: int, length: int, max_tokens: int) -> tuple[int, ...]:
    """The request alone through mlx-lm's `generate_step` (greedy; the tiny models have no EOS in range)."""
    tokens = []
    for token, _ in generate_step(mx.array(_prompt(i, length)), _model(spec_name), max_tokens=max_tokens,
                                  prefill_step_size=PREFILL_STEP_SIZE):
        tokens.append(int(token))
    return tuple(tokens)


def _row(model: Any, i: int, length: int, max_tokens: int) -> tuple[SoloRow, int]:
    row = SoloRow(model, f"r{i}", _prompt(i, length), SamplingParams(max_tokens=max_tokens),
                  prefill_step_size=PREFILL_STEP_SIZE)
    while row.prefill_remaining:
        row.prefill_chunk()
    return row, row.first_token()


class Driver:
    """Runs a DecodeBatch as the decode-step actor does: steps, then settle (flush, leave, join)."""

    def __init__(self, spec_name: str = "llama", max_rows: int | None = None) -> None:
        self.spec_name = spec_name
        self.model = _model(spec_name)
        self.batch = DecodeBatch(self.model, max_rows=max_rows)
        self.tokens: dict[str, list[int]] = {}
        self.budget: dict[str, int] = {}

    def _record(self, ids: list[str], decoded: Any) -> None:
        if decoded is None:
            return
        for rid, token in zip(ids, decoded.token_ids):
            if len(self.tokens[rid]) < self.budget[rid]:  # past it: the pipeline's wasted token
                self.tokens[rid].append(token)

    def step(self) -> None:
        ids = self.batch.request_ids
        self._record(ids, self.batch.step_decoded())

    def settle(self, leaving: list[str], joining: list[tuple[int, int, int]]) -> None:
        ids = self.batch.request_ids
        if ids:
            self._record(ids, self.batch.flush_decoded())
        if leaving:
            self.batch.leave(leaving)
        joiners = []
        for i, length, max_tokens in joining:
            row, token0 = _row(self.model, i, length, max_tokens)
            self.tokens[row.request_id], self.budget[row.request_id] = [token0], max_tokens
            joiners.append((row, token0))
        if joiners:
            self.batch.join_many(joiners)

    def finished(self) -> list[str]:
        return [rid for rid in self.batch.request_ids if len(self.tokens[rid]) >= self.budget[rid]]


@st.composite
def churns(draw: st.DrawFn) -> list[list[tuple[int, int, int]]]:
    """Per settle, the rows that join: (index, prompt length, max_tokens); rows leave when done."""
    n = 0
    settles = []
    for _ in range(draw(st.integers(2, 8))):
        joining = []
        for _ in range(draw(st.integers(0, 3))):
            joining.append((n, draw(st.integers(1, 48)), draw(st.integers(1, 10))))
            n += 1
        settles.append(joining)
    return settles


def _run_churn(settles: list[list[tuple[int, int, int]]], spec_name: str = "llama",
               steps_between: int = 2, max_rows: int | None = None) -> Driver:
    driver = Driver(spec_name, max_rows)
    queue = list(settles)
    while queue or driver.batch.size:
        joining = queue.pop(0) if queue else []
        driver.settle(driver.finished(), joining)
        for _ in range(steps_between):
            if driver.batch.size and not driver.finished():
                driver.step()
    assert driver.batch.nbytes == 0
    return driver


def _assert_solo_tokens(driver: Driver, settles: list[list[tuple[int, int, int]]]) -> None:
    for joining in settles:
        for i, length, max_tokens in joining:
            assert tuple(driver.tokens[f"r{i}"]) == _solo_tokens(driver.spec_name, i, length, max_tokens), i


@settings(max_examples=20, deadline=None)
@given(settles=churns(), steps_between=st.integers(1, 3))
def test_random_joins_and_leaves_decode_each_rows_solo_tokens(settles: list[list[tuple[int, int, int]]],
                                                              steps_between: int) -> None:
    _assert_solo_tokens(_run_churn(settles, steps_between=steps_between), settles)


def test_a_churning_schedule_reuses_freed_slots_and_matches_solo() -> None:
    """Rows of every length leave while others join, and the joiners land in freed slots (not appended)."""
    settles = [[(0, 40, 30), (1, 5, 3), (2, 17, 9), (3, 30, 30)], [(4, 3, 6)], [(5, 12, 5), (6, 44, 4)],
               [(7, 8, 7)], [(8, 2, 12), (9, 25, 3)], [], [(10, 19, 5)]]
    seen_holes = []
    driver = Driver()
    queue = list(settles)
    while queue or driver.batch.size:
        driver.settle(driver.finished(), queue.pop(0) if queue else [])
        seen_holes.append(driver.batch.row_slots != list(range(driver.batch.size)))
        for _ in range(2):
            if driver.batch.size and not driver.finished():
                driver.step()
    assert any(seen_holes)  # some joiner took a freed slot in the middle
    _assert_solo_tokens(driver, settles)


def test_sliding_window_model_keeps_mlx_lm_filter_and_extend() -> None:
    """Rotating layers take the path without slots (and still decode each row's solo tokens)."""
    settles = [[(0, 30, 8), (1, 9, 3), (2, 20, 8)], [(3, 12, 6)], [(4, 5, 4)]]
    driver = Driver("llama_swa")
    queue = list(settles)
    while queue or driver.batch.size:
        driver.settle(driver.finished(), queue.pop(0) if queue else [])
        assert driver.batch.row_slots == list(range(driver.batch.size))
        for _ in range(2):
            if driver.batch.size and not driver.finished():
                driver.step()
    _assert_solo_tokens(driver, settles)


def _layer_buffers(batch: DecodeBatch) -> list[int]:
    return [id(c.keys) for c in batch._caches]


def test_leave_moves_no_row_and_a_shorter_joiner_copies_no_other_row(monkeypatch: pytest.MonkeyPatch) -> None:
    relayouts = []
    real = row_slots.relayout
    monkeypatch.setattr(row_slots, "relayout", lambda *a: (relayouts.append(a[1:]), real(*a))[1])
    driver = Driver()
    driver.settle([], [(0, 40, 50), (1, 30, 50), (2, 20, 50), (3, 35, 50)])
    driver.step()
    batch = driver.batch
    shape = batch._caches[0].keys.shape
    buffers = _layer_buffers(batch)
    driver.settle(["r1"], [])  # a leave: r1's slot is freed, nothing else moves
    assert batch.row_slots == [0, 2, 3]
    assert batch._caches[0].keys.shape == shape and _layer_buffers(batch) == buffers
    driver.settle([], [(4, 10, 50)])  # shorter than the batch: written into slot 1 in place
    assert batch.row_slots == [0, 2, 3, 1]
    assert batch._caches[0].keys.shape == shape and _layer_buffers(batch) == buffers
    assert relayouts == []
    driver.step()
    driver.settle([], [(5, 200, 50)])  # longer than the batch, and no free slot: one re-layout per layer
    assert len(relayouts) == len(batch._caches) and batch.size == 5
    for _ in range(3):
        driver.step()
    driver.settle(list(batch.request_ids), [])
    for rid, (i, length) in {"r0": (0, 40), "r2": (2, 20), "r3": (3, 35), "r4": (4, 10), "r5": (5, 200)}.items():
        got = driver.tokens[rid]
        assert tuple(got) == _solo_tokens("llama", i, length, 50)[:len(got)], rid


def test_slots_grow_up_to_max_rows_and_compact_when_mostly_free() -> None:
    driver = Driver(max_rows=10)
    driver.settle([], [(i, 10 + i, 50) for i in range(8)])
    driver.step()
    driver.settle(["r0"], [(8, 5, 50), (9, 6, 50)])  # one free slot, two joiners: grow by 1/8, at least one
    assert driver.batch._num_slots == 9 and sorted(driver.batch.row_slots) == list(range(9))
    driver.step()
    driver.settle(["r1", "r2", "r3"], [])  # 3 of 9 free: over a quarter, compacted to the rows
    assert driver.batch._num_slots == 6 and driver.batch.row_slots == list(range(6))
    driver.step()
    driver.settle(list(driver.batch.request_ids), [])
    for i in range(4, 10):
        got = driver.tokens[f"r{i}"]
        assert tuple(got) == _solo_tokens("llama", i, 10 + i if i < 8 else i - 3, 50)[:len(got)], i
