"""Speculation over quantized KV (`--kv-bits` with `--prompt-lookup` / `--draft-model`): greedy speculative rows
equal the plain quantized rows of the same scheme, B=1 and batched, under random proposals.

The plain quantized rows are themselves checked against mlx-lm's serial `generate_step(kv_bits=...)` in
tests/engine/batch/test_batch_quantized.py; here the B=1 plain row is checked against it again, so the
speculative row is tied to mlx-lm directly. Proposals come from the same oracle as the bf16 verification
tests (true tokens, then wrong ones, random per row and step), so rollbacks of every length occur.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load

from mlx_trio.engine.batch.decode_batch import Decoded
from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.speculative.speculator import SpeculationConfig
from mlx_trio.params import SamplingParams
from mlx_trio.testing.batch_reference import Arrival
from mlx_trio.testing.tiny_models import tiny_model
from tests.engine.batch.batch_driver import run_schedule
from tests.engine.batch.test_batch_quantized import LLAMA_Q, STEP, _prompt, _serial
from tests.engine.speculative.test_verification import K, _oracle, _tokens

SCHEMES = [KvScheme(bits=4, group_size=32, start=0), KvScheme(bits=8, group_size=64, start=0),
           KvScheme(bits=4, group_size=32, start=30)]  # the last: rows cross the start while decoding


@cache
def _llama() -> tuple[Any, tuple[int, ...]]:
    model, tokenizer = load(str(tiny_model(LLAMA_Q)))
    return model, tuple(tokenizer.eos_token_ids)


def _run(arrivals: list[Arrival], scheme: KvScheme, speculation: SpeculationConfig | None = None,
         steps: list[Decoded] | None = None) -> dict[str, Any]:
    model, eos = _llama()
    return run_schedule(model, arrivals, eos=eos, prefill_step_size=STEP, kv_scheme=scheme, speculation=speculation,
                        steps=steps)


def _accepted(steps: list[Decoded]) -> int:
    return sum(sum(d.accepted) for d in steps)


def test_b1_speculative_rows_equal_the_plain_quantized_row_and_mlx_lm() -> None:
    model, eos = _llama()
    for scheme in SCHEMES:
        arrivals = [Arrival("a", 0, _prompt(1, 21), SamplingParams(max_tokens=40))]
        plain = _run(arrivals, scheme)
        assert plain["a"].tokens == _serial(model, arrivals[0].prompt_ids, 40, eos, scheme)
        for speculation in (SpeculationConfig.prompt_lookup(K, 2), SpeculationConfig.draft(model, K),
                            _oracle(plain, arrivals), _oracle(plain, arrivals, full=True)):
            steps: list[Decoded] = []
            assert _tokens(_run(arrivals, scheme, speculation, steps)) == _tokens(plain), (scheme, speculation)
        assert _accepted(steps) > 0  # the full oracle's proposals were verified, not skipped


def test_a_batch_below_the_start_steps_plainly_until_it_converts() -> None:
    """Start 30, a 21-token prompt: plain steps feed tokens 22..30 (the 9th converts the row), then it speculates."""
    arrivals = [Arrival("a", 0, _prompt(1, 21), SamplingParams(max_tokens=40))]
    scheme = KvScheme(bits=4, group_size=32, start=30)
    plain = _run(arrivals, scheme)
    steps: list[Decoded] = []
    assert _tokens(_run(arrivals, scheme, _oracle(plain, arrivals, full=True), steps)) == _tokens(plain)
    first_verify = next(i for i, d in enumerate(steps) if any(d.proposed))
    assert all(d.forwards == 1 and not d.proposed for d in steps[:first_verify])
    assert first_verify == 9
    assert _accepted(steps) > 0


SCHEDULE = [(0, 21, 40), (3, 9, 30), (5, 40, 25), (9, 5, 30), (30, 12, 20)]


def _arrivals(rows: list[tuple[int, int, int]]) -> list[Arrival]:
    """(at_step, prompt length, max_tokens) per request."""
    return [Arrival(f"r{i}", at, _prompt(i, n), SamplingParams(max_tokens=m)) for i, (at, n, m) in enumerate(rows)]


def _check_serial(arrivals: list[Arrival], scheme: KvScheme, speculation: SpeculationConfig,
                  steps: list[Decoded] | None = None) -> None:
    """Every speculative row == mlx-lm's serial run quantized from where its batch converted it.

    With a start above 0 that point depends on the batch a row sits in (engine/kv/kv_scheme.py), and
    speculative rows finish in fewer steps than plain ones, so rows meet other batches than in the plain
    run: the plain batch is not their oracle, their serial run is.
    """
    model, eos = _llama()
    converted: dict[str, int] = {}
    got = run_schedule(model, arrivals, eos=eos, prefill_step_size=STEP, kv_scheme=scheme, speculation=speculation,
                       converted_at=converted, steps=steps)
    for a in arrivals:
        start = min(scheme.start, converted.get(a.request_id, scheme.start))
        assert got[a.request_id].tokens == _serial(model, a.prompt_ids, a.params.max_tokens, eos, scheme, start), \
            (a.request_id, start)


def test_join_and_leave_with_random_proposals_keep_every_row_on_the_plain_quantized_run() -> None:
    """Quantized from the start: every row's batch is quantized throughout, so speculative rows == plain rows."""
    arrivals = _arrivals(SCHEDULE)
    for scheme in SCHEMES[:2]:
        plain = _run(arrivals, scheme)
        for seed in range(2):
            steps: list[Decoded] = []
            assert _tokens(_run(arrivals, scheme, _oracle(plain, arrivals, seed), steps)) == _tokens(plain), \
                (scheme, seed)
            assert _accepted(steps) > 0
            assert sum(sum(d.proposed) for d in steps) > _accepted(steps)  # rejections happened


def test_rows_crossing_the_start_while_speculating_stay_on_their_serial_oracle() -> None:
    arrivals = _arrivals(SCHEDULE)
    scheme = SCHEMES[2]
    plain = _run(arrivals, scheme)
    for seed in range(2):
        steps: list[Decoded] = []
        _check_serial(arrivals, scheme, _oracle(plain, arrivals, seed), steps)
        assert _accepted(steps) > 0


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 16)), min_size=1, max_size=5),
       st.sampled_from([0, 10, 30]), st.integers(0, 2**16))
def test_random_schedules_and_proposals_keep_every_row_on_its_oracle(
        rows: list[tuple[int, int, int]], start: int, seed: int) -> None:
    """Random joins and leaves of quantized and not-yet-quantized rows, random proposals: start 0, each row ==
    the plain quantized run's; any start, each row == its serial oracle."""
    arrivals = _arrivals(rows)
    scheme = KvScheme(bits=4, group_size=32, start=start)
    plain = _run(arrivals, scheme)
    speculation = _oracle(plain, arrivals, seed)
    if start == 0:
        assert _tokens(_run(arrivals, scheme, speculation)) == _tokens(plain)
    _check_serial(arrivals, scheme, speculation)
