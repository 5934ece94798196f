"""B=1 through the batch lane (SoloRow, then DecodeBatch) == mlx-lm stream_generate, token for token."""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_trio.engine.batch.decode_batch import DecodeBatch
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, TinyModelSpec, tiny_model

from mlx_trio.testing import batch_reference
from tests.engine.batch.batch_driver import token_ids

MODELS = {"llama": LLAMA, "qwen3": QWEN3, "llama_swa": LLAMA_SWA}
MAX_TOKENS = 24
# Longer than llama_swa's window (16), prefilled in chunks of 7: crosses chunk and window edges.
PROMPT = [(13 * i + 5) % 500 + 3 for i in range(37)]
CASES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "seeded_temp": {"temperature": 0.9, "seed": 3},
    "seeded_top_p": {"temperature": 0.8, "top_p": 0.9, "seed": 7},
    "seeded_top_k_min_p": {"temperature": 1.0, "top_k": 20, "min_p": 0.05, "seed": 5},
    "seeded_penalties": {"temperature": 0.7, "seed": 11, "repetition_penalty": 1.3, "presence_penalty": 0.5,
                         "frequency_penalty": 0.3},
    "greedy_bias_penalty": {"logit_bias": ((42, 4.0), (7, -100.0)), "repetition_penalty": 1.1},
}


@cache
def _load(spec: TinyModelSpec) -> tuple[Any, Any]:
    return load(str(tiny_model(spec)))


def _mlx_lm_sampling(params: SamplingParams) -> dict[str, Any]:
    return {
        "sampler": make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k),
        "logits_processors": make_logits_processors(
            logit_bias=dict(params.logit_bias) or None, repetition_penalty=params.repetition_penalty or None,
            presence_penalty=params.presence_penalty or None, frequency_penalty=params.frequency_penalty or None,
        ),
    }


def batch_lane_tokens(model: Any, prompt: list[int], params: SamplingParams, *, prefill_step_size: int) -> list[int]:
    """A lone request through the batch lane: solo prefill, token 0, join an empty batch, pipelined steps."""
    row = SoloRow(model, "only", prompt, params, prefill_step_size=prefill_step_size)
    while row.prefill_chunk():
        pass
    tokens = [row.first_token()]
    batch = DecodeBatch(model)
    batch.join_many([(row, tokens[0])])
    assert batch.is_solo and row.nbytes == 0  # adopted, not copied
    while len(tokens) < params.max_tokens:
        out = token_ids(batch.step_decoded())
        if out is not None:
            tokens += out
    batch.close()
    assert batch.nbytes == 0
    return tokens


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", MODELS)
def test_batch_lane_b1_matches_stream_generate(name: str, case: str) -> None:
    """Same ids as stream_generate (up to its EOS), greedy and seeded, across chunk and window edges."""
    model, tokenizer = _load(MODELS[name])
    params = SamplingParams(max_tokens=MAX_TOKENS, **CASES[case])
    if params.seed is not None:
        mx.random.seed(params.seed)
    want = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS, prefill_step_size=7,
                                             **_mlx_lm_sampling(params))]
    got = batch_lane_tokens(model, PROMPT, params, prefill_step_size=7)
    assert got[: len(want)] == want
    assert len(want) >= 8  # an early EOS would make the comparison weak


@pytest.mark.parametrize("case", ["greedy", "seeded_penalties"])
def test_hybrid_recurrent_b1_matches_generate_step(case: str) -> None:
    """A tiny qwen3_next (ArraysCache + KVCache layers) at B=1 == mlx-lm generate_step."""
    model = batch_reference.tiny_qwen3_next()
    prompt = [p % 250 + 3 for p in PROMPT]
    params = SamplingParams(max_tokens=MAX_TOKENS, **CASES[case])
    if params.seed is not None:
        mx.random.seed(params.seed)
    steps = generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, prompt_cache=make_prompt_cache(model),
                          prefill_step_size=7, **_mlx_lm_sampling(params))
    want = [token for token, _ in steps]
    assert batch_lane_tokens(model, prompt, params, prefill_step_size=7) == want
