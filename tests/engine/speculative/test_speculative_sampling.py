"""Sampled rows under speculation draw from the target's distribution: a chi-square test over many seeds.

The proposer offers, after token 0, the most likely next token (and a wrong
one after it), so the first speculative position accepts often and rejects
often. The joint frequencies of (token 0, token 1) over 400 seeded rows
must fit the target's own distribution, computed here from the model's
logits with mlx-lm's top-k and temperature, at p = 0.001.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_top_k

from mlx_trio.engine.batch.decode_batch import Decoded
from mlx_trio.engine.speculative.speculator import SpeculationConfig
from mlx_trio.params import SamplingParams
from mlx_trio.testing.batch_reference import Arrival
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.engine.batch.batch_driver import run_schedule

PROMPT = tuple(range(40, 52))
TEMPERATURE, TOP_K = 0.7, 4
ROWS, PER_BATCH = 400, 40


def _distribution(model: Any, tokens: Sequence[int]) -> dict[int, float]:
    """The target's next-token probabilities after `tokens` (top-k, then temperature, as the sampler draws)."""
    logits = model(mx.array([list(tokens)]), cache=make_prompt_cache(model))[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    probs = mx.softmax(apply_top_k(logprobs, TOP_K) * (1 / TEMPERATURE), axis=-1)[0].tolist()
    return {t: p for t, p in enumerate(probs) if p > 0}


class _MostLikely:
    def __init__(self, best: dict[int, int], tokens: Sequence[int]) -> None:
        self._best, self._tokens = best, list(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens += tokens

    def propose(self, k: int) -> list[int]:
        if len(self._tokens) != len(PROMPT) + 1:
            return []
        best = self._best[self._tokens[-1]]
        return [best, (best + 1) % 500 + 3][:k]


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (z of the normal's), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_token_frequencies_under_speculation_match_the_target_distribution() -> None:
    model, tokenizer = load(str(tiny_model(LLAMA)))
    first = _distribution(model, PROMPT)
    second = {t0: _distribution(model, (*PROMPT, t0)) for t0 in first}
    best = {t0: max(d, key=d.__getitem__) for t0, d in second.items()}
    speculation = SpeculationConfig(2, lambda _rid, tokens: _MostLikely(best, tokens))
    counts: Counter[tuple[int, int]] = Counter()
    steps: list[Decoded] = []
    for start in range(0, ROWS, PER_BATCH):
        arrivals = [Arrival(f"r{i}", 0, PROMPT, SamplingParams(max_tokens=2, temperature=TEMPERATURE, top_k=TOP_K,
                                                               seed=i)) for i in range(start, start + PER_BATCH)]
        outcomes = run_schedule(model, arrivals, eos=(), speculation=speculation, steps=steps)
        counts.update(tuple(o.tokens) for o in outcomes.values())  # type: ignore[misc]
    accepted = sum(sum(d.accepted) for d in steps)
    assert ROWS // 10 < accepted < ROWS  # the proposals were accepted, and rejected, often
    expected = {(t0, t1): ROWS * p0 * p1 for t0, p0 in first.items() for t1, p1 in second[t0].items()}
    assert set(counts) <= set(expected)  # nothing outside the target's support
    cells = [(counts[c], e) for c, e in expected.items() if e >= 5]
    rest = (ROWS - sum(o for o, _ in cells), ROWS - sum(e for _, e in cells))
    if rest[1] >= 5:
        cells.append(rest)
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    assert statistic < _chi_square_critical(len(cells) - 1), (statistic, cells)
