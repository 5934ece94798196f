"""An agent loop's next turn always hits the prompt cache (issue #19, point 1).

A turn's finish-time put is visible to lookups (as a pending put) before its
final event reaches the session, so a follow-up sent the moment that event
arrives finds the previous prompt + completion in the cache: 100 zero-gap
turns in a row, streamed and not, chat and raw prompts, a lone row and a
batched one, through the embeddable API and through the openai SDK.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import openai
import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.actors.decode_step import EXTRACT_MIN_PROMPT_TOKENS
from mlx_trio.config import EngineConfig
from mlx_trio.events import Finished, TextDelta
from mlx_trio.http import ServerConfig
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.http.http_helpers import ServerThread

TURNS = 100
# A prompt this long is put at finish even while batched (decode_step.EXTRACT_MIN_PROMPT_TOKENS).
SYSTEM = "You are a careful agent. Use the tools, read their results, answer in plain words. " * 7
# The tiny model's replies are steered to words (" the", " sea", " and"), so the re-rendered
# reply mostly tokenizes as generated (its first token loses its leading space in the text).
WORDS = {263: 50.0, 354: 50.0, 272: 50.0}


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


async def _turn(engine: Any, prompt: Any, *, streamed: bool) -> tuple[str, tuple[int, ...], Finished]:
    if not streamed:
        done = await engine.complete(prompt, max_tokens=6, logit_bias=WORDS)
        finished = Finished(done.finish_reason, done.usage)
        return done.text, done.token_ids, finished
    texts: list[str] = []
    ids: list[int] = []
    async for event in engine.generate(prompt, max_tokens=6, logit_bias=WORDS):
        if isinstance(event, TextDelta):
            texts.append(event.text)
            ids.extend(event.token_ids)
        elif isinstance(event, Finished):
            return "".join(texts), tuple(ids), event
    raise AssertionError("no Finished event")


async def _background(engine: Any, stop: trio.Event) -> None:
    """Keep another row decoding, so the conversation's rows are batched."""
    eos = next(iter(engine.model.eos_token_ids))
    while not stop.is_set():
        async for _ in engine.generate("Tell a very long story about the sea.", max_tokens=64,
                                       logit_bias={eos: -100.0}):
            if stop.is_set():
                break


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "raw"])
@pytest.mark.parametrize("batched", [False, True], ids=["lone", "batched"])
async def test_a_hundred_zero_gap_follow_ups_each_reuse_the_previous_turn(chat: bool, batched: bool) -> None:
    """Turns alternate streamed and whole (`Engine.complete`), each sent right after the last one's end."""
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            if batched:
                nursery.start_soon(_background, engine, stop)
                while not engine.actors.lane.decoding:
                    await trio.sleep(0.01)
            messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": "Start the task."}]
            raw = SYSTEM + "\nStart the task.\n"
            previous: tuple[int, ...] | None = None
            previous_prompt = 0
            for turn in range(TURNS):
                prompt = messages if chat else raw
                prompt_ids = engine.prepare(prompt, max_tokens=6).prompt_ids
                assert len(prompt_ids) >= EXTRACT_MIN_PROMPT_TOKENS
                text, ids, finished = await _turn(engine, prompt, streamed=bool(turn % 2))
                if previous is not None:
                    # The previous prompt + completion, less the tail the template re-rendered
                    # differently, less the last generated token (never fed, so not in the entry).
                    reusable = min(_shared(previous, prompt_ids), len(previous) - 1, len(prompt_ids) - 1)
                    assert reusable >= previous_prompt
                    assert finished.usage.cached_tokens >= reusable, f"turn {turn} missed the previous turn"
                previous, previous_prompt = prompt_ids + ids, len(prompt_ids)
                # Zero think time: the next turn goes out right after the final event.
                tool_result = f"Read {turn % 10}."
                if chat:
                    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": tool_result}]
                else:
                    raw += text + "\n" + tool_result + "\n"
            stop.set()
        caching = engine.actors.lane.caching
        assert caching is not None
        with trio.fail_after(10):
            while caching.cache.pending:  # the last turn's row leaves the batch just after its final event
                await trio.sleep(0.01)


def test_follow_ups_through_the_openai_sdk_hit_the_cache() -> None:
    """Non-streamed and streamed chat turns over HTTP, each sent as soon as the last one returned.

    Over the wire only counts are seen: each turn reuses at least the whole previous prompt (its
    reply re-renders with its first token changed, see WORDS), which only the previous turn's
    finish-time put holds (the prefill snapshot stops at the last message boundary).
    """
    config = EngineConfig(model=str(tiny_model(LLAMA)), batch=4)
    with ServerThread(config, ServerConfig(port=0)) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Start."}]
        last_prompt = last_completion = 0
        for turn in range(20):
            if turn % 2:
                chunks = list(client.chat.completions.create(
                    model="any", messages=messages, max_tokens=6, stream=True, logit_bias=WORDS,
                    stream_options={"include_usage": True}))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
            else:
                done = client.chat.completions.create(model="any", messages=messages, max_tokens=6,
                                                      logit_bias=WORDS)
                text, usage = done.choices[0].message.content or "", done.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens or 0
            if turn:
                assert cached >= last_prompt, f"turn {turn} missed"
            last_prompt, last_completion = usage.prompt_tokens, usage.completion_tokens
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Result {turn}."}]

