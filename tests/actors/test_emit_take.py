"""The decode actor's per-row take of a report's tokens (`_taken`) against the step-by-step take."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from mlx_trio.actors.decode_step import RunningRow, _take_speculative, _taken
from mlx_trio.engine.batch.decode_batch import Decoded

EOS = frozenset({2, 7})


def _row(generated: int, max_tokens: int) -> RunningRow:
    request = SimpleNamespace(params=SimpleNamespace(max_tokens=max_tokens))
    return RunningRow(request, generated=list(range(100, 100 + generated)))  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(200))
def test_taken_is_the_step_by_step_take(seed: int) -> None:
    rng = random.Random(seed)
    tokens = tuple(rng.choice([1, 2, 3, 7, 9, 11]) if rng.random() < 0.3 else rng.randrange(20, 40)
                   for _ in range(rng.randrange(1, 6)))
    generated, max_tokens = rng.randrange(1, 8), rng.randrange(1, 10)
    steps = [Decoded((t,), (None,)) for t in tokens]
    reference = _row(generated, max_tokens)
    want_tokens, _, want_reason = _take_speculative(reference, 0, steps, EOS)

    row = _row(generated, max_tokens)
    count, reason = _taken(row, tokens, EOS)
    assert (tokens[:count], reason) == (want_tokens, want_reason)
    assert row.generated == list(range(100, 100 + generated))  # `_taken` only counts: the caller appends


def test_a_stop_token_at_the_length_limit_is_a_stop() -> None:
    assert _taken(_row(3, 5), (30, 7, 31), EOS) == (2, _taken(_row(0, 9), (7,), EOS)[1])
    assert _taken(_row(3, 5), (30, 31, 32), EOS)[0] == 2
    assert _taken(_row(3, 9), (30, 31), EOS) == (2, None)
