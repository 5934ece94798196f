"""Rows with mixed sampling options in one DecodeBatch: each decodes exactly its tokens and logprobs alone.

Hypothesis draws up to 8 rows with random arrivals and option mixes (greedy
and seeded; logit_bias; repetition/presence/frequency penalties with their
windows; top-p, min-p, top-k; logprobs with top-k alternatives). Every row's
tokens and logprobs must equal the row alone on the serial graph, sampled by
its own `RowSampler` step by step (pinned to mlx-lm by
tests/engine/sampling/test_row_sampler.py): nothing of the batch's sampler is
in the oracle. The tiny float32 Llama's batched logits are bit-identical to
the serial ones on the CPU.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load

from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.sampling.token_logprobs import to_record
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.engine.batch.batch_driver import Arrival, Outcome, run_schedule


@cache
def _model() -> tuple[Any, tuple[int, ...]]:
    model, tokenizer = load(str(tiny_model(LLAMA)))
    return model, tuple(tokenizer.eos_token_ids)


@st.composite
def _params(draw: st.DrawFn) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": draw(st.integers(1, 14))}
    if draw(st.booleans()):
        kwargs |= {"temperature": draw(st.sampled_from([0.6, 1.0, 1.5])), "seed": draw(st.integers(0, 2**32)),
                   "top_p": draw(st.sampled_from([1.0, 0.9])), "min_p": draw(st.sampled_from([0.0, 0.05])),
                   "top_k": draw(st.sampled_from([0, 0, 10, 40]))}
    if draw(st.booleans()):
        kwargs["logit_bias"] = tuple(draw(st.dictionaries(st.integers(3, 511), st.sampled_from([-100.0, 3.0, 8.0]),
                                                          min_size=1, max_size=2)).items())
    for penalty in ("repetition", "presence", "frequency"):
        if draw(st.integers(0, 2)) == 0:
            kwargs[f"{penalty}_penalty"] = draw(st.sampled_from([0.8, 1.3, 2.0]))
            kwargs[f"{penalty}_context_size"] = draw(st.sampled_from([2, 20, 100]))
    if draw(st.integers(0, 2)) == 0:
        kwargs |= {"logprobs": True, "top_logprobs": draw(st.sampled_from([0, 3]))}
    return SamplingParams(**kwargs)


@st.composite
def _arrivals(draw: st.DrawFn) -> list[Arrival]:
    out = []
    for i in range(draw(st.integers(2, 8))):
        length = draw(st.integers(1, 30))
        prompt = tuple(draw(st.lists(st.integers(3, 511), min_size=length, max_size=length)))
        out.append(Arrival(f"r{i}", draw(st.integers(0, 5)), prompt, draw(_params())))
    return out


def _serial(model: Any, a: Arrival, eos: tuple[int, ...]) -> Outcome:
    """The row alone: prefill, token 0, then one forward and one `RowSampler.sample` per token."""
    row = SoloRow(model, a.request_id, a.prompt_ids, a.params, prefill_step_size=8)
    while row.prefill_chunk():
        pass
    out = Outcome([row.first_token()], [row.token0_logprobs])
    sampler = row.sampler
    while out.tokens[-1] not in eos and len(out.tokens) < a.params.max_tokens:
        token = mx.array([out.tokens[-1]], dtype=mx.uint32)
        token = sampler.sample(model(token[None], cache=row.caches)[:, -1, :], token)
        out.tokens.append(token.item())
        sampler.accept(out.tokens[-1])
        out.logprobs.append(to_record(sampler.last_logprobs) if sampler.last_logprobs is not None else None)
    row.close()
    return out


@settings(max_examples=12, deadline=None)
@given(arrivals=_arrivals())
def test_mixed_option_rows_decode_their_solo_tokens(arrivals: list[Arrival]) -> None:
    """Token for token and logprob for logprob, every row of a mixed batch equals the row alone."""
    model, eos = _model()
    got = run_schedule(model, arrivals, eos=eos)
    for a in arrivals:
        alone = _serial(model, a, eos)
        assert got[a.request_id].tokens == alone.tokens, a
        assert got[a.request_id].logprobs == alone.logprobs, a
