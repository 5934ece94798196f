"""A cohort prefilled as one batch leaves every row where a solo prefill leaves it (engine/batch/cohort_prefill.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load

from mlx_trio.engine.batch.cohort_prefill import can_prefill_together, prefill_rows, prefill_together
from mlx_trio.engine.prompt_cache.ram_tier import CacheHit
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model

GREEDY = SamplingParams(max_tokens=8)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, logprobs=True, top_logprobs=3)


def _prompt(salt: int, n: int) -> list[int]:
    return [(13 * salt + 7 * j) % 500 + 3 for j in range(n)]


@pytest.fixture(scope="module")
def model():
    return load(str(tiny_model(LLAMA)))[0]


def _solo(model, rid: str, prompt: list[int], params: SamplingParams, hit: CacheHit | None = None) -> SoloRow:
    row = SoloRow(model, rid, prompt, params, hit=hit)
    while row.prefill_remaining:
        row.prefill_chunk()
    row.first_token()
    return row


def _kv(row: SoloRow) -> list[np.ndarray]:
    return [np.array(a) for c in row.caches for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])]


def test_a_cohort_row_equals_its_solo_prefill_whatever_its_length_and_cached_prefix(model) -> None:
    shared = _prompt(1, 20)
    entry = _solo(model, "s", [*shared, 9], GREEDY).snapshot()  # the KV of `shared`
    specs = {  # rid: (prompt, params, hit)
        "long": (_prompt(2, 41), GREEDY, None),
        "short": (_prompt(3, 7), GREEDY, None),
        "hit": ([*shared, *_prompt(4, 15)], GREEDY, CacheHit(entry, 20)),
        "trimmed hit": ([*shared[:12], *_prompt(5, 25)], GREEDY, CacheHit(entry, 12)),
        "two tokens": (_prompt(6, 2), GREEDY, None),
        "one token": (_prompt(7, 1), GREEDY, None),
        "seeded": (_prompt(8, 30), SEEDED, None),
    }
    alone = {rid: _solo(model, rid, *spec) for rid, spec in specs.items()}
    rows = [SoloRow(model, rid, prompt, params, hit=hit) for rid, (prompt, params, hit) in specs.items()]
    assert can_prefill_together(rows)
    prefill_together(model, rows)
    for row in rows:
        solo = alone[row.request_id]
        assert (row.token0, row.fed, row.cached_tokens) == (solo.token0, solo.fed, solo.cached_tokens)
        assert [c.offset for c in row.caches] == [c.offset for c in solo.caches]
        for got, want in zip(_kv(row), _kv(solo), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4)
    seeded = next(row for row in rows if row.request_id == "seeded")
    assert seeded.token0_logprobs is not None and alone["seeded"].token0_logprobs is not None
    got, want = seeded.token0_logprobs, alone["seeded"].token0_logprobs
    assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    # The rows go on decoding on their own caches, like solo rows (the cohort's batch caches are gone).
    for row in rows:
        last = mx.array([row.token0])
        solo = alone[row.request_id]
        got = mx.argmax(model(last[None], cache=row.caches)[0, -1]).item()
        want = mx.argmax(model(last[None], cache=solo.caches)[0, -1]).item()
        assert got == want


def test_only_plain_kv_models_prefill_together_and_the_others_match_solo_exactly() -> None:
    swa = load(str(tiny_model(LLAMA_SWA)))[0]
    prompts = [_prompt(i, 10 + 9 * i) for i in range(3)]
    rows = [SoloRow(swa, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    assert not can_prefill_together(rows)
    outcomes = prefill_rows(swa, [lambda p=p, i=i: SoloRow(swa, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    assert [r.token0 for r in outcomes] == [_solo(swa, "x", p, GREEDY).token0 for p in prompts]


class _FailsBatched:
    """The model, except that a forward of more than one row raises (a batch-only failure)."""

    def __init__(self, model) -> None:
        self._model = model
        self.layers = model.layers

    def __call__(self, inputs, cache=None):
        if inputs.shape[0] > 1:
            raise RuntimeError("batched forward failed")
        return self._model(inputs, cache=cache)


def test_a_failed_cohort_forward_fails_its_rows_only_and_frees_them(model) -> None:
    broken = _FailsBatched(model)
    made: list[SoloRow] = []

    def make(i: int) -> SoloRow:
        made.append(SoloRow(broken, f"r{i}", _prompt(i, 12 + i), GREEDY))
        return made[-1]

    def bad_maker() -> SoloRow:
        raise ValueError("bad request")

    outcomes = prefill_rows(broken, [lambda: make(0), bad_maker, lambda: make(1)])
    assert isinstance(outcomes[1], ValueError)
    assert all(isinstance(outcomes[i], RuntimeError) for i in (0, 2))
    assert all(row.caches == [] for row in made)
    # A lone row never batches: the same wrapper prefills it fine.
    (alone,) = prefill_rows(broken, [lambda: SoloRow(broken, "alone", _prompt(0, 12), GREEDY)])
    assert isinstance(alone, SoloRow) and alone.token0 == _solo(model, "x", _prompt(0, 12), GREEDY).token0


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 24)), min_size=2, max_size=5))
def test_any_cohort_equals_solo_prefills(model, specs: list[tuple[int, int]]) -> None:
    """Random prompt lengths and cache-hit lengths (0: none) over one shared prefix entry."""
    shared = _prompt(1, 24)
    entry = _solo(model, "s", [*shared, 9], GREEDY).snapshot()
    cases = []
    for i, (length, usable) in enumerate(specs):
        usable = min(usable, length - 1)
        prompt = [*shared[:usable], *_prompt(10 + i, length - usable)]
        cases.append((f"r{i}", prompt, CacheHit(entry, usable) if usable else None))
    alone = [_solo(model, rid, prompt, GREEDY, hit) for rid, prompt, hit in cases]
    rows = [SoloRow(model, rid, prompt, GREEDY, hit=hit) for rid, prompt, hit in cases]
    prefill_together(model, rows)
    for row, solo in zip(rows, alone, strict=True):
        assert (row.token0, row.fed) == (solo.token0, solo.fed)
        for got, want in zip(_kv(row), _kv(solo), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4)


def test_under_prefill_only_cudnn_a_cohort_prefills_each_row_alone(model) -> None:
    """A batched forward would be a new cuDNN shape per cohort: each row runs its own (planned) chunks instead,
    in the same job, with no batched forward at all and exactly the solo rows' tokens."""
    from mlx_trio.engine.kv import decode_layout

    prompts = [_prompt(i, 10 + 9 * i) for i in range(3)]
    fails_batched = _FailsBatched(model)
    decode_layout.set_active(True)
    try:
        assert not can_prefill_together([SoloRow(model, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
        outcomes = prefill_rows(fails_batched, [lambda p=p, i=i: SoloRow(fails_batched, f"r{i}", p, GREEDY)
                                                for i, p in enumerate(prompts)])
    finally:
        decode_layout.set_active(False)
    assert [r.token0 for r in outcomes] == [_solo(model, "x", p, GREEDY).token0 for p in prompts]


def test_rows_prefilled_in_sequence_are_bit_identical_to_solo_rows(model) -> None:
    """`prefill_in_sequence` launches each forward without waiting for it: the same kernels, so every row's KV,
    token 0 and token-0 logprobs equal a solo prefill's exactly, over several chunks a row and seeded sampling."""
    from mlx_trio.engine.batch.cohort_prefill import can_prefill_in_sequence, prefill_in_sequence
    from mlx_trio.engine.kv import decode_layout

    prompts = [_prompt(i, 20 + 13 * i) for i in range(4)]
    params = [GREEDY, SEEDED, GREEDY, SEEDED]
    decode_layout.set_active(True)
    try:
        rows = [SoloRow(model, f"r{i}", p, q, prefill_step_size=16) for i, (p, q) in enumerate(zip(prompts, params))]
        assert can_prefill_in_sequence(rows)
        prefill_in_sequence(rows)
        solos = []
        for i, (p, q) in enumerate(zip(prompts, params)):
            solo = SoloRow(model, f"s{i}", p, q, prefill_step_size=16)
            while solo.prefill_remaining:
                solo.prefill_chunk()
            solo.first_token()
            solos.append(solo)
    finally:
        decode_layout.set_active(False)
    for row, solo in zip(rows, solos, strict=True):
        assert (row.token0, row.fed, row.token0_logprobs) == (solo.token0, solo.fed, solo.token0_logprobs)
        for got, want in zip(_kv(row), _kv(solo), strict=True):
            np.testing.assert_array_equal(got, want)


def test_rows_outside_prefill_only_cudnn_or_storing_a_snapshot_do_not_prefill_in_sequence(model) -> None:
    from mlx_trio.engine.batch.cohort_prefill import can_prefill_in_sequence
    from mlx_trio.engine.kv import decode_layout

    rows = [SoloRow(model, "a", _prompt(1, 30), GREEDY)]
    assert not can_prefill_in_sequence(rows)  # decode_layout off: prefill_rows' batched or eager paths
    decode_layout.set_active(True)
    try:
        assert can_prefill_in_sequence(rows)
        assert not can_prefill_in_sequence([SoloRow(model, "b", _prompt(2, 30), GREEDY, snapshot_at=12)])
    finally:
        decode_layout.set_active(False)
