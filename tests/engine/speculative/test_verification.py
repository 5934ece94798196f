"""Speculative steps in the decode batch: every row's tokens and KV equal the non-speculative run.

The proposal oracle (`Oracle`) knows each request's true greedy continuation
(from a plain run) and proposes, per step, a random number of true tokens
followed by a random number of wrong ones: full acceptance, rejection at
every position, and rows without a proposal all occur, per row and step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cache
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_trio.engine.batch.decode_batch import DecodeBatch, Decoded
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry
from mlx_trio.engine.speculative.speculator import SpeculationConfig
from mlx_trio.params import SamplingParams
from mlx_trio.testing.batch_reference import Arrival
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model
from tests.engine.batch.batch_driver import Outcome, run_schedule

K = 3
KV_TOLERANCE = 1e-4  # a [B, 1+K] forward sums in another order than [B, 1]; float32 on the CPU


@cache
def _llama() -> tuple[Any, tuple[int, ...]]:
    model, tokenizer = load(str(tiny_model(LLAMA)))
    return model, tuple(tokenizer.eos_token_ids)


def _arrivals(schedule: Sequence[tuple[int, int, int]], **params: Any) -> list[Arrival]:
    """(at_step, prompt length, max_tokens) per request; prompts repeat a pattern so lookup finds matches."""
    return [Arrival(f"r{i}", at, tuple((11 * i + 5 * (j % 7) + j % 3) % 500 + 3 for j in range(n)),
                    SamplingParams(max_tokens=m, **params))
            for i, (at, n, m) in enumerate(schedule)]


class Oracle:
    """Proposes `true[:cut] + wrong * extra` with `cut`, `extra` drawn per step (the truth from a plain run)."""

    def __init__(self, truth: dict[str, tuple[int, list[int]]], seed: int, request_id: str,
                 tokens: Sequence[int], *, garbage: bool = True, full: bool = False) -> None:
        self._prompt_length, self._true = truth[request_id]
        self._tokens = list(tokens)
        self._rng = random.Random(f"{seed}-{request_id}")
        self._garbage, self._full = garbage, full

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens += tokens

    def propose(self, k: int) -> list[int]:
        generated = len(self._tokens) - self._prompt_length
        true = self._true[generated:generated + k]
        if self._full:
            return true
        cut = self._rng.randint(0, k)
        wrong = (true[cut] + 1) % 500 + 3 if cut < len(true) else 3  # never the true next token
        return true[:cut] + [wrong] * (self._rng.randint(0, k - cut) if self._garbage else 0)


def _oracle(plain: dict[str, Outcome], arrivals: list[Arrival], seed: int = 0, **kwargs: Any) -> SpeculationConfig:
    truth = {a.request_id: (len(a.prompt_ids), plain[a.request_id].tokens) for a in arrivals}
    return SpeculationConfig(K, lambda rid, tokens: Oracle(truth, seed, rid, tokens, **kwargs))


def _tokens(outcomes: dict[str, Outcome]) -> dict[str, list[int]]:
    return {rid: o.tokens for rid, o in outcomes.items()}


def _assert_same_kv(got: dict[str, CacheEntry | None], want: dict[str, CacheEntry | None]) -> None:
    """Each row's KV at its leave holds the same tokens, and the same keys and values, as the plain run's."""
    assert got.keys() == want.keys()
    for rid in want:
        g, w = got[rid], want[rid]
        assert g is not None and w is not None
        n = min(len(g.tokens), len(w.tokens))
        assert g.tokens[:n] == w.tokens[:n]
        for gc, wc in zip(g.caches, w.caches, strict=True):
            for ga, wa in ((gc.keys, wc.keys), (gc.values, wc.values)):
                np.testing.assert_allclose(np.array(ga[..., :n, :]), np.array(wa[..., :n, :]), atol=KV_TOLERANCE)


def _forwards(steps: list[Decoded]) -> int:
    return sum(d.forwards for d in steps)


SCHEDULE = [(0, 21, 40), (3, 9, 30), (5, 40, 25), (9, 5, 30), (30, 12, 20)]


def test_b1_equals_mlx_lm_and_plain_run_with_every_proposal_source() -> None:
    model, eos = _llama()
    arrivals = _arrivals([(0, 30, 60)])
    plain = run_schedule(model, arrivals, eos=eos)
    want = []
    for token, _ in generate_step(mx.array(arrivals[0].prompt_ids), model, max_tokens=60, prefill_step_size=8):
        want.append(int(token))
        if want[-1] in eos:
            break
    assert plain["r0"].tokens == want
    for speculation in (SpeculationConfig.prompt_lookup(K, 3), _oracle(plain, arrivals),
                        _oracle(plain, arrivals, full=True)):
        assert _tokens(run_schedule(model, arrivals, eos=eos, speculation=speculation)) == _tokens(plain)


def test_full_acceptance_takes_one_forward_per_k_plus_1_tokens() -> None:
    model, eos = _llama()
    arrivals = _arrivals([(0, 30, 41)])
    plain = run_schedule(model, arrivals, eos=eos)
    steps: list[Decoded] = []
    got = run_schedule(model, arrivals, eos=eos, speculation=_oracle(plain, arrivals, full=True), steps=steps)
    assert _tokens(got) == _tokens(plain)
    generated = len(plain["r0"].tokens)
    # Token 0 comes from prefill; then each forward verifies K true proposals and adds the bonus token.
    assert _forwards(steps) == -(-(generated - 1) // (K + 1))
    assert sum(sum(d.accepted) for d in steps) >= (generated - 1) - _forwards(steps) - K


def test_join_and_leave_with_random_proposals_keep_tokens_and_kv() -> None:
    model, eos = _llama()
    arrivals = _arrivals(SCHEDULE)
    plain_kv: dict[str, CacheEntry | None] = {}
    plain = run_schedule(model, arrivals, eos=eos, entries=plain_kv)
    for seed in range(3):
        kv: dict[str, CacheEntry | None] = {}
        steps: list[Decoded] = []
        got = run_schedule(model, arrivals, eos=eos, speculation=_oracle(plain, arrivals, seed), entries=kv,
                           steps=steps)
        assert _tokens(got) == _tokens(plain)
        _assert_same_kv(kv, plain_kv)
        assert sum(sum(d.accepted) for d in steps) > 0
        assert sum(sum(d.proposed) for d in steps) > sum(sum(d.accepted) for d in steps)  # rejections happened


def test_prompt_lookup_under_join_and_leave() -> None:
    model, eos = _llama()
    arrivals = _arrivals(SCHEDULE)
    plain = run_schedule(model, arrivals, eos=eos)
    assert _tokens(run_schedule(model, arrivals, eos=eos, speculation=SpeculationConfig.prompt_lookup(K, 3))) \
        == _tokens(plain)


@st.composite
def _schedules(draw: st.DrawFn) -> list[Arrival]:
    arrivals = []
    for i in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 30))
        arrivals.append(Arrival(f"r{i}", draw(st.integers(0, 8)),
                                tuple(draw(st.lists(st.integers(3, 511), min_size=length, max_size=length))),
                                SamplingParams(max_tokens=draw(st.integers(1, 16)))))
    return arrivals


@settings(max_examples=10, deadline=None)
@given(_schedules(), st.integers(0, 2**16))
def test_random_proposals_keep_every_row_equal_to_the_plain_run(arrivals: list[Arrival], seed: int) -> None:
    model, eos = _llama()
    plain_kv: dict[str, CacheEntry | None] = {}
    plain = run_schedule(model, arrivals, eos=eos, entries=plain_kv)
    kv: dict[str, CacheEntry | None] = {}
    got = run_schedule(model, arrivals, eos=eos, speculation=_oracle(plain, arrivals, seed), entries=kv)
    assert _tokens(got) == _tokens(plain)
    _assert_same_kv(kv, plain_kv)


def test_sampled_penalised_and_logprob_rows_speculate_and_keep_their_tokens() -> None:
    """Seeded sampling (filters, penalties, logit bias) and logprobs under random proposals: the plain tokens.

    Each verified position draws with the key plain decoding would use there, so a seeded row
    emits its plain tokens; logprobs are the target's, as plain decoding reports them.
    """
    model, eos = _llama()
    options = [dict(temperature=0.8, seed=5, top_p=0.9), dict(repetition_penalty=1.3, logit_bias=((7, 2.0),)),
               dict(logprobs=True, top_logprobs=2), dict(temperature=1.2, seed=9, top_k=20, min_p=0.05,
                                                         presence_penalty=0.4, frequency_penalty=0.3), {}]
    arrivals = [Arrival(a.request_id, a.at_step, a.prompt_ids, SamplingParams(max_tokens=a.params.max_tokens, **o))
                for a, o in zip(_arrivals(SCHEDULE), options, strict=True)]
    plain = run_schedule(model, arrivals, eos=eos)
    for seed in range(2):
        steps: list[Decoded] = []
        got = run_schedule(model, arrivals, eos=eos, speculation=_oracle(plain, arrivals, seed), steps=steps)
        assert _tokens(got) == _tokens(plain)
        for outcome, want in ((got["r2"], plain["r2"]),):
            assert [lp.top[0][0] for lp in outcome.logprobs] == [lp.top[0][0] for lp in want.logprobs]  # type: ignore
            np.testing.assert_allclose([lp.logprob for lp in outcome.logprobs],  # type: ignore[union-attr]
                                       [lp.logprob for lp in want.logprobs], atol=KV_TOLERANCE)  # type: ignore
        assert sum(sum(d.accepted) for d in steps) > 0


def test_constrained_rows_speculate_only_what_the_grammar_allows_and_opted_out_rows_never() -> None:
    """A JSON-schema row verifies only the proposals its grammar allows (a forbidden one is cut before the
    forward), every verified position under the grammar's mask there; its output validates and equals the
    plain run's, as every row's does. The row that sent `speculative: false` never has a proposal."""
    import json

    from mlx_trio.engine.sampling.grammar import build_grammar_tokenizer
    from mlx_trio.params import Constraint

    model, tokenizer = load(str(tiny_model(LLAMA)))
    grammar = build_grammar_tokenizer(tokenizer, tokenizer.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "b": {"type": "string", "maxLength": 12}},
              "required": ["a", "b"], "additionalProperties": False}
    constrained = SamplingParams(max_tokens=60, constraint=Constraint("json_schema", json.dumps(schema)))
    arrivals = [Arrival(a.request_id, 0, a.prompt_ids, params) for a, params in zip(_arrivals(SCHEDULE[:4]), [
        SamplingParams(max_tokens=30), SamplingParams(max_tokens=30, speculative=False), constrained,
        attrs.evolve(constrained, temperature=0.9, seed=4)])]
    eos = tuple(tokenizer.eos_token_ids)
    plain = run_schedule(model, arrivals, eos=eos, grammar_tokenizer=grammar)
    for full in (True, False):
        steps: list[Decoded] = []
        got = run_schedule(model, arrivals, eos=eos, grammar_tokenizer=grammar,
                           speculation=_oracle(plain, arrivals, full=full), steps=steps)
        assert _tokens(got) == _tokens(plain)
        for rid in ("r2", "r3"):
            assert got[rid].finish_reason == "stop"
            json.loads(tokenizer.decode([t for t in got[rid].tokens if t not in eos]))
        proposing = [d.proposed for d in steps if d.proposed]
        assert all(p[1] == 0 for p in proposing if len(p) > 1)  # r1: speculative=False
        assert sum(p[2] for p in proposing if len(p) > 2) > 0  # the constrained row speculated
        assert sum(sum(d.accepted) for d in steps) > 0


def test_sliding_window_models_do_not_speculate() -> None:
    model, _ = load(str(tiny_model(LLAMA_SWA)))
    assert DecodeBatch(model, speculation=SpeculationConfig.prompt_lookup(K, 3))._speculator is None
