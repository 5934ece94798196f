"""The embeddable API: validation, stop strings, cancellation, status, on a tiny model."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.errors import ContextTooLong, InvalidParameter
from mlx_trio.events import Finished, PromptProgress, TextDelta
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

from tests.goldens import golden



@pytest.fixture(params=[1, 8], ids=["batch-1", "batch-8"])
async def engine(request):
    async with open_engine(str(tiny_model(LLAMA)), batch=request.param) as engine:
        yield engine


def _cancelled(engine) -> int:
    lane = engine.actors.lane
    return lane.decode_step.statistics().cancelled + lane.prefill.statistics().cancelled


def _restarts(tree: dict[str, Any]) -> int:
    return tree.get("restarts", 0) + sum(_restarts(c) for c in tree.get("children", []))


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"max_tokens": -1}, "max_tokens"),
        ("hi", {"top_k": -1}, "top_k"),
        ("hi", {"top_k": 10**6}, "top_k"),
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"stop": 17}, "stop"),
        ("hi", {"stop": [None]}, "stop"),
        ([10**9], {}, "prompt"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "messages[0].content[0]"),
        (42, {}, "prompt"),
    ],
)
async def test_bad_input_raises_typed_error_naming_the_field_and_no_actor_dies(engine, prompt, kwargs, field) -> None:
    """Each bad input raises InvalidParameter for its field; the tree is untouched and still serves."""
    with pytest.raises(InvalidParameter) as info:
        async for _ in engine.generate(prompt, **kwargs):
            pass
    assert info.value.field == field
    assert _restarts(engine.status()["tree"]) == 0
    done = await engine.complete("Once upon a time there was", max_tokens=3)
    assert done.usage.completion_tokens == 3


async def test_max_tokens_over_the_context_is_clamped_or_refused(engine) -> None:
    """max_tokens beyond the room the prompt leaves is lowered to that room; clamp_max_tokens=False refuses it."""
    limit = engine.model.context_length
    n = engine.count_tokens("hello")
    assert n == len(engine.prepare("hello").prompt_ids)
    assert engine.prepare("hello", max_tokens=limit).params.max_tokens == limit - n
    assert engine.prepare("hello", max_tokens=limit - n).params.max_tokens == limit - n
    with pytest.raises(ContextTooLong, match=f"{n} \\+ {limit} > {limit}"):
        engine.prepare("hello", max_tokens=limit, clamp_max_tokens=False)


async def test_a_prompt_that_fills_the_context_is_too_long(engine) -> None:
    """A prompt that leaves no room for one token: ContextTooLong in the words harnesses read to compact."""
    limit = engine.model.context_length
    with pytest.raises(ContextTooLong, match=f"^prompt is too long: {limit} tokens > {limit - 1} maximum"):
        engine.prepare([7] * limit, max_tokens=1)


async def test_stream_shape_progress_then_deltas_then_one_finished(engine) -> None:
    """Events come as PromptProgress*, TextDelta*, then exactly one Finished with usage."""
    kinds = [type(e) async for e in engine.generate("Once upon a time there was", max_tokens=5)]
    assert kinds[0] is PromptProgress
    assert kinds[-1] is Finished and kinds.count(Finished) == 1
    assert kinds.index(TextDelta) > kinds.index(PromptProgress)


async def test_stop_string_cuts_the_text_of_the_golden_generation(engine) -> None:
    """A stop string taken from the middle of a golden text ends the output right before it."""
    case = golden("llama", "greedy_raw")
    text = case["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    done = await engine.complete(case["prompt"], **case["params"], stop=[stop])
    assert done.finish_reason == "stop"
    assert done.text == text[: text.find(stop)]
    assert stop not in done.text
    events = [e async for e in engine.generate(case["prompt"], **case["params"], stop=[stop])]
    assert isinstance(events[-1], Finished) and events[-1].stop_sequence == stop


async def test_leaving_the_stream_early_cancels_and_frees_the_kv_cache(engine) -> None:
    """Breaking out after two deltas ends the request; no KV bytes stay and the decoder serves on."""
    deltas = 0
    async for event in engine.generate("Once upon a time there was", max_tokens=200):
        if isinstance(event, TextDelta):
            deltas += 1
            if deltas == 2:
                break
    with trio.fail_after(10):
        while engine.status()["counters"]["kv_bytes"] or engine.status()["counters"]["active_rows"]:
            await trio.sleep(0.01)
    assert _cancelled(engine) == 1
    done = await engine.complete("Once upon a time there was", max_tokens=2)
    assert done.usage.completion_tokens == 2


async def test_concurrent_requests_all_finish_with_their_own_answers(engine) -> None:
    """Three overlapping greedy requests each get exactly their solo answer (FIFO at --batch 1, batched at 8)."""
    case = golden("llama", "greedy_raw")
    results: list[str] = []

    async def one() -> None:
        results.append((await engine.complete(case["prompt"], **case["params"])).text)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert results == [case["text"]] * 3


async def test_status_tree_names_each_actor_and_counts(engine) -> None:
    """status() shows root → engine (gpu-lease, then the lane's actors) and sessions, all running."""
    tree = engine.status()["tree"]
    assert tree["id"] == "root"
    engine_sup = next(c for c in tree["children"] if c["id"] == "engine")
    lane = ["decode-step", "prefill", "admission", "cache-persistence"]  # every --batch runs the one lane
    assert [c["id"] for c in engine_sup["children"]] == ["gpu-lease", *lane]
    assert all(c["state"] == "running" for c in engine_sup["children"])
    assert engine.health() == (True, "ok")


async def test_every_mlx_call_of_a_request_runs_on_the_lease_thread(engine, monkeypatch) -> None:
    """Prefill, steps and the final free all run on the lease's own OS thread."""
    import threading

    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow

    watched = {SoloRow: ("__init__", "prefill_chunk", "first_token"),
               DecodeBatch: ("join_many", "step_decoded", "flush_decoded", "leave")}
    seen: list[tuple[str, int]] = []
    for cls, names in watched.items():
        for name in names:
            original = getattr(cls, name)

            def wrapper(self, *args, _original=original, _name=name, **kwargs):
                seen.append((_name, threading.get_ident()))
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(cls, name, wrapper)
    await engine.complete("Once upon a time there was " * 4, max_tokens=3)
    with trio.fail_after(5):
        while not any(name == "leave" for name, _ in seen):
            await trio.sleep(0.01)
    lease_thread = engine.actors.lane.lease.statistics().thread_id
    assert {name for name, _ in seen} == {n for names in watched.values() for n in names}
    assert {ident for _, ident in seen} == {lease_thread}
    assert lease_thread != threading.get_ident()
