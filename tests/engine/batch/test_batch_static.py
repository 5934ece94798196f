"""Static B=4, equal prompt lengths, greedy: every row == mlx-lm BatchGenerator at B=4, token for token.

mlx-lm prefills the four prompts as one batch; we prefill each alone and
join (adopt, merge, extend, extend). In float32 on the CPU each row's
full-attention numerics are batch-invariant, so even the log-probabilities
are bit-identical. Sliding-window layers are laid out differently (mlx-lm's
batched prefill leaves the ring in its own order; our merge rebuilds it in
temporal order), which reorders the attention sums: there the tokens are
equal and log-probabilities agree to 1e-4.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, TinyModelSpec, tiny_model

from mlx_trio.testing import batch_reference as ref

MODELS = {"llama": LLAMA, "qwen3": QWEN3, "llama_swa": LLAMA_SWA}
MAX_TOKENS = 20
PROMPT_LEN = 24  # > llama_swa's window of 16


@cache
def _load(spec: TinyModelSpec) -> tuple[Any, Any]:
    return load(str(tiny_model(spec)))


def _mlx_lm_batch(model: Any, prompts: list[list[int]], eos: list[int]) -> list[tuple[list[int], list[mx.array]]]:
    """Tokens and log-probabilities per prompt from mlx-lm's BatchGenerator (greedy, all inserted at once)."""
    gen = BatchGenerator(model, stop_tokens=[[t] for t in eos], max_tokens=MAX_TOKENS)
    try:
        uids = gen.insert(prompts)
        out: dict[int, tuple[list[int], list[mx.array]]] = {uid: ([], []) for uid in uids}
        while responses := gen.next_generated():
            for r in responses:
                out[r.uid][0].append(r.token)
                out[r.uid][1].append(r.logprobs)
    finally:
        gen.close()
    return [out[uid] for uid in uids]


@pytest.mark.parametrize("name", MODELS)
def test_static_b4_matches_batch_generator(name: str) -> None:
    """Four equal-length prompts: same tokens per row as BatchGenerator; logprobs exact for full attention."""
    model, tokenizer = _load(MODELS[name])
    eos = list(tokenizer.eos_token_ids)
    prompts = [[(7 * r + 3 * i) % 500 + 3 for i in range(PROMPT_LEN)] for r in range(4)]
    want = _mlx_lm_batch(model, prompts, eos)
    arrivals = [ref.Arrival(f"r{i}", 0, tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for i, p in enumerate(prompts)]
    got = ref.run_schedule(ref.ours(model), arrivals, eos=eos)
    assert got.max_batch == 4
    worst = 0.0
    for i, (tokens, logprobs) in enumerate(want):
        rid = f"r{i}"
        assert got.tokens[rid] == tokens
        for index, lp in enumerate(logprobs):
            logits = got.logits[(rid, index)]
            ours = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            worst = max(worst, mx.abs(ours - lp).max().item())
    assert worst <= (1e-4 if MODELS[name].sliding_window else 0.0)
    assert sum(len(t) for t, _ in want) >= 4 * 8  # not an early-EOS triviality
