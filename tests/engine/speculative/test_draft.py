"""A draft model proposing in the batch: its own batched KV, rolled back by row; tokens equal the plain run's.

The tiny model as its own draft proposes exactly what the target emits
(greedy), so every proposal is accepted and each forward yields K+1 tokens
(a check of the draft's KV and its rollback: one wrong position and the
draft would diverge). A tiny model with other weights proposes tokens the
target rejects. B=1 is also checked against mlx-lm's `speculative_generate_step`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import speculative_generate_step

from mlx_trio.engine.batch.decode_batch import Decoded
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry
from mlx_trio.engine.speculative.speculator import SpeculationConfig
from mlx_trio.params import SamplingParams
from mlx_trio.testing.batch_reference import Arrival
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.engine.batch.batch_driver import run_schedule
from tests.engine.speculative.test_verification import SCHEDULE, _arrivals, _assert_same_kv, _tokens

K = 3


@cache
def _models() -> tuple[Any, Any, tuple[int, ...]]:
    model, tokenizer = load(str(tiny_model(LLAMA)))
    other, _ = load(str(tiny_model(attrs.evolve(LLAMA, seed=1))))
    return model, other, tuple(tokenizer.eos_token_ids)


def test_b1_equals_mlx_lm_speculative_generate_and_the_plain_run() -> None:
    model, other, eos = _models()
    arrivals = _arrivals([(0, 30, 60)])
    plain = run_schedule(model, arrivals, eos=eos)
    for draft in (model, other):
        want = []
        for token, _, _ in speculative_generate_step(mx.array(arrivals[0].prompt_ids), model, draft,
                                                     num_draft_tokens=K, max_tokens=60, prefill_step_size=8):
            want.append(int(token))
            if want[-1] in eos:
                break
        assert want == plain["r0"].tokens
        got = run_schedule(model, arrivals, eos=eos, speculation=SpeculationConfig.draft(draft, K))
        assert _tokens(got) == _tokens(plain)


def test_the_model_as_its_own_draft_accepts_every_greedy_proposal() -> None:
    model, _, eos = _models()
    arrivals = _arrivals([(0, 30, 61)])
    plain = run_schedule(model, arrivals, eos=eos)
    steps: list[Decoded] = []
    got = run_schedule(model, arrivals, eos=eos, speculation=SpeculationConfig.draft(model, K), steps=steps)
    assert _tokens(got) == _tokens(plain)
    generated = len(plain["r0"].tokens)
    assert sum(d.forwards for d in steps) == -(-(generated - 1) // (K + 1))
    assert sum(sum(d.accepted) for d in steps) == sum(sum(d.proposed) for d in steps) > 0


def test_join_and_leave_keep_tokens_and_kv_with_either_draft() -> None:
    model, other, eos = _models()
    arrivals = _arrivals(SCHEDULE)
    plain_kv: dict[str, CacheEntry | None] = {}
    plain = run_schedule(model, arrivals, eos=eos, entries=plain_kv)
    for draft, all_accepted in ((model, True), (other, False)):
        kv: dict[str, CacheEntry | None] = {}
        steps: list[Decoded] = []
        got = run_schedule(model, arrivals, eos=eos, speculation=SpeculationConfig.draft(draft, K), entries=kv,
                           steps=steps)
        assert _tokens(got) == _tokens(plain)
        _assert_same_kv(kv, plain_kv)
        accepted, proposed = (sum(sum(getattr(d, f)) for d in steps) for f in ("accepted", "proposed"))
        assert proposed > 0 and (accepted == proposed) == all_accepted


def test_sampled_rows_with_a_draft_keep_their_seeded_tokens() -> None:
    model, _, eos = _models()
    options = [dict(temperature=0.9, seed=1), dict(temperature=0.6, seed=2, top_k=8), {},
               dict(repetition_penalty=1.2, logprobs=True), dict(temperature=1.0, seed=3, speculative=False)]
    arrivals = [Arrival(a.request_id, a.at_step, a.prompt_ids, SamplingParams(max_tokens=a.params.max_tokens, **o))
                for a, o in zip(_arrivals(SCHEDULE), options, strict=True)]
    plain = run_schedule(model, arrivals, eos=eos)
    steps: list[Decoded] = []
    got = run_schedule(model, arrivals, eos=eos, speculation=SpeculationConfig.draft(model, K), steps=steps)
    assert _tokens(got) == _tokens(plain)
    assert 0 < sum(sum(d.accepted) for d in steps) < sum(sum(d.proposed) for d in steps)


def test_a_draft_never_proposes_an_id_past_the_targets_vocabulary() -> None:
    """A draft head wider than the target's embedding (padded vocabularies) is cut at the target's size."""
    model, _, eos = _models()
    arrivals = _arrivals([(0, 20, 24)])
    plain = run_schedule(model, arrivals, eos=eos)
    steps: list[Decoded] = []
    # A vocabulary of 7 ids: every proposal is one of them, so most are rejected, and none reads past it.
    got = run_schedule(model, arrivals, eos=eos, speculation=SpeculationConfig.draft(model, K, vocab_size=7),
                       steps=steps)
    assert _tokens(got) == _tokens(plain)
    assert sum(sum(d.proposed) for d in steps) > 0


def test_the_batch_counts_the_drafts_kv() -> None:
    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow

    model, _, _ = _models()
    sizes = []
    for speculation in (None, SpeculationConfig.draft(model, K)):
        batch = DecodeBatch(model, speculation=speculation)
        row = SoloRow(model, "r0", tuple(range(3, 40)), SamplingParams(max_tokens=8))
        while row.prefill_chunk():
            pass
        batch.join_many([(row, row.first_token())])
        sizes.append(batch.nbytes)
        batch.close()
    assert sizes[1] > sizes[0] > 0
