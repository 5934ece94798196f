"""--prompt-lookup and --draft-model through the whole lane: the same tokens as without it, fewer steps, counted in stats and usage.

Every comparison is against the same engine without speculation (exact token
ids). The tiny model's greedy output falls into repeats, which prompt lookup
then proposes, so proposals are verified, accepted and rejected.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.config import EngineConfig
from mlx_trio.errors import ModelLoadError
from mlx_trio.events import Finished, TextDelta
from mlx_trio.testing.tiny_models import LLAMA, TinyModelSpec, tiny_model

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "Once upon a time there was a fox. Once upon a",
           "the cat sat on the mat, the cat sat on the", "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"]


async def _completions(engine: Any, requests: list[dict[str, Any]]) -> list[Any]:
    out: list[Any] = [None] * len(requests)

    async def one(i: int) -> None:
        out[i] = await engine.complete(**requests[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(requests)):
            nursery.start_soon(one, i)
    return out


def _requests() -> list[dict[str, Any]]:
    return [dict(prompt=PROMPTS[3], max_tokens=200), dict(prompt=PROMPTS[1], max_tokens=45),
            dict(prompt=PROMPTS[2], max_tokens=50, speculative=False),
            dict(prompt=PROMPTS[3], max_tokens=40, temperature=0.7, seed=3),
            dict(prompt=PROMPTS[2], max_tokens=33, repetition_penalty=1.2)]


@pytest.fixture(scope="module")
def plain_ids() -> list[tuple[int, ...]]:
    async def run() -> list[tuple[int, ...]]:
        async with open_engine(str(tiny_model(LLAMA)), batch=1) as engine:
            return [(await engine.complete(**r)).token_ids for r in _requests()]
    return trio.run(run)


@pytest.mark.parametrize("batch", [1, 4])
async def test_same_tokens_as_plain_decoding_and_the_counters_add_up(batch: int, plain_ids: Any) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=batch, prompt_lookup=True, num_draft_tokens=3) as engine:
        done = await _completions(engine, _requests())
        assert [d.token_ids for d in done] == plain_ids
        counters = engine.status()["counters"]
    proposed, accepted = counters["speculative_proposed"], counters["speculative_accepted"]
    assert 0 < accepted < proposed
    # A request counts the steps it took tokens from; the lane also those run past a row's end (discarded).
    assert 0 < sum(d.usage.speculative_proposed for d in done) <= proposed
    assert 0 < sum(d.usage.speculative_accepted for d in done) <= accepted
    # Every row speculates (sampled and penalised ones too) but the one that sent speculative=False.
    assert done[2].usage.speculative_proposed == 0
    assert done[0].usage.speculative_accepted > 0
    # Token 0 of each request comes from its prefill; every other token from a decode step.
    assert counters["decoded_tokens"] == sum(len(d.token_ids) - 1 for d in done)
    # A row's every decoded token that was not an accepted proposal took a forward of its own.
    assert counters["decode_steps"] >= max(len(d.token_ids) - 1 - d.usage.speculative_accepted for d in done)


async def test_stop_strings_max_tokens_and_cancellation_inside_accepted_runs(plain_ids: Any) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prompt_lookup=True) as engine:
        plain = await engine.complete(PROMPTS[3], max_tokens=200)
        assert plain.token_ids == plain_ids[0] and plain.usage.speculative_accepted > 0
        stop = plain.text[len(plain.text) // 2:][:4]
        want = plain.text[:plain.text.index(stop)]
        stopped = await engine.complete(PROMPTS[3], max_tokens=200, stop=stop)
        assert stopped.text == want and stopped.finish_reason == "stop"
        for n in (1, 2, 7, 13, 150):
            assert (await engine.complete(PROMPTS[3], max_tokens=n)).token_ids == plain_ids[0][:n]
        async for _ in engine.generate(PROMPTS[3], max_tokens=200):
            break  # leaves mid-run: the row is cancelled
        assert (await engine.complete(PROMPTS[3], max_tokens=200)).token_ids == plain_ids[0]


@pytest.mark.parametrize("draft", [False, True])
async def test_resume_after_a_decode_step_crash_mid_answer_gives_the_same_tokens(plain_ids: Any, draft: bool) -> None:
    """The decoder dies after the first tokens came out: the request resumes and ends with the plain tokens."""
    path = str(tiny_model(LLAMA))
    options: dict[str, Any] = {"draft_model": path} if draft else {"prompt_lookup": True}
    async with open_engine(path, batch=4, **options) as engine:
        ids: list[int] = []
        async for event in engine.generate(PROMPTS[3], max_tokens=200):
            if isinstance(event, TextDelta):
                ids += event.token_ids
                if not engine.faults.armed() and not engine.faults.fired:
                    engine.faults.arm("decode-step", "raise")
            elif isinstance(event, Finished):
                assert event.usage.completion_tokens == len(plain_ids[0])
        assert engine.faults.fired
        assert ids == [t for t in plain_ids[0] if t not in engine.model.eos_token_ids]


def test_the_settings_are_checked_when_the_config_is_built() -> None:
    for bad in ({"num_draft_tokens": 0}, {"prompt_lookup_ngram": 0}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)


async def test_a_draft_model_gives_the_same_tokens_and_its_own_proposals_are_all_accepted(plain_ids: Any) -> None:
    """The tiny model as its own --draft-model: every greedy proposal is accepted; sampled rows keep their tokens."""
    path = str(tiny_model(LLAMA))
    async with open_engine(path, batch=4, draft_model=path, num_draft_tokens=3) as engine:
        done = await _completions(engine, _requests())
        assert [d.token_ids for d in done] == plain_ids
    greedy = done[0].usage
    assert greedy.speculative_accepted == greedy.speculative_proposed > 0


async def test_a_draft_with_another_tokenizer_is_refused_at_start() -> None:
    other = str(tiny_model(TinyModelSpec("llama", tools=True)))
    with pytest.raises(ExceptionGroup) as info:  # open_engine's nursery wraps what wait_ready raised
        async with open_engine(str(tiny_model(LLAMA)), draft_model=other):
            pass
    assert info.group_contains(ModelLoadError, match="another tokenizer")


async def test_admission_counts_the_drafts_kv_and_weights() -> None:
    path = str(tiny_model(LLAMA))
    async with open_engine(path) as plain:
        alone = plain.model
    async with open_engine(path, draft_model=path) as drafted:
        both = drafted.model
    assert both.kv_layout.full_bytes_per_token == 2 * alone.kv_layout.full_bytes_per_token
    assert both.weights_bytes == 2 * alone.weights_bytes
