"""The session actor and the one resume loop (`Engine.stream`): exact streams across crashes; cancellation frees KV."""

from __future__ import annotations

import pytest
import trio

from mlx_trio import api, open_engine
from mlx_trio.actors.messages import Generate, TokensDecoded
from mlx_trio.actors.session import SessionActor
from mlx_trio.api import MAX_RESUMES
from mlx_trio.errors import EngineRestarted
from mlx_trio.events import Finished, TextDelta
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.prompts import PROMPTS


async def _stream(engine, prompt: str, max_tokens: int, *, crash_after: int | None = None) -> tuple[tuple[int, ...], str]:
    ids: list[int] = []
    text = ""
    async for event in engine.generate(prompt, max_tokens=max_tokens):
        if isinstance(event, TextDelta):
            ids.extend(event.token_ids)
            text += event.text
            if crash_after is not None and len(ids) >= crash_after:
                engine.faults.arm("session", "raise")  # the session crashes at its next event
                crash_after = None
    return tuple(ids), text


@pytest.mark.parametrize("batch", [1, 4], ids=["batch-1", "batch-4"])
async def test_a_crashed_session_resumes_and_the_stream_stays_exact(batch: int) -> None:
    """The session dies mid-stream; its successor carries on: same ids, same text, nothing repeated."""
    async with open_engine(str(tiny_model(LLAMA)), batch=batch) as engine:
        undisturbed = await _stream(engine, PROMPTS[2], 30)
        resumed = await _stream(engine, PROMPTS[2], 30, crash_after=5)
        assert engine.faults.fired
    assert resumed == undisturbed and len(undisturbed[0]) == 30


@pytest.mark.parametrize("crash_after", [5, 6, 7, 8])
async def test_a_resume_submitted_at_once_never_gets_the_last_attempts_tokens(
        monkeypatch: pytest.MonkeyPatch, crash_after: int) -> None:
    """With no resume delay the lane may still hold the crashed attempt's row when the next one joins: each
    attempt has an id of its own, so its tokens never reach the other's row (they did: a repeated token)."""
    monkeypatch.setattr(api, "MAX_RESUME_DELAY_S", 0.0)
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        undisturbed = await _stream(engine, PROMPTS[2], 30)
        resumed = await _stream(engine, PROMPTS[2], 30, crash_after=crash_after)
        assert engine.faults.fired
    assert resumed == undisturbed


async def test_sessions_that_crash_without_progress_give_up_with_engine_restarted() -> None:
    """More than MAX_RESUMES attempts in a row that bring no token: EngineRestarted, and the engine serves on."""
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        for _ in range(MAX_RESUMES + 1):
            engine.faults.arm("session", "raise")
        with pytest.raises(EngineRestarted):
            await engine.complete(PROMPTS[0], max_tokens=4)
        assert not engine.faults.armed() and len(engine.faults.fired) == MAX_RESUMES + 1
        done = await engine.complete(PROMPTS[0], max_tokens=4)
        assert done.usage.completion_tokens == 4


@pytest.mark.parametrize("batch", [1, 4], ids=["batch-1", "batch-4"])
async def test_leaving_the_stream_cancels_and_frees_kv_and_the_reservation(batch: int) -> None:
    """Breaking out at the first delta ends the request: no row, no KV bytes, no reservation; the lane serves on."""
    async with open_engine(str(tiny_model(LLAMA)), batch=batch) as engine:
        lane = engine.actors.lane
        async for event in engine.generate(PROMPTS[1], max_tokens=200):
            if isinstance(event, TextDelta):
                break
        with trio.fail_after(10):
            # The request may still sit in a channel between actors: wait until its reservation is gone.
            while lane.in_flight() or engine.status()["counters"]["kv_bytes"] or lane.admission.statistics().reserved_bytes:
                await trio.sleep(0.01)
        assert lane.decode_step.statistics().cancelled + lane.prefill.statistics().cancelled == 1
        events = [e async for e in engine.generate(PROMPTS[1], max_tokens=3)]
        assert isinstance(events[-1], Finished)


async def test_restarts_while_a_request_only_queues_do_not_count_as_its_fruitless_attempts() -> None:
    """More than MAX_RESUMES admission crashes while a request waits behind a running row: it still completes.

    With `--batch 1` the running row holds the only slot; each resubmission of the queued request
    crashes admission (rest_for_one: the running row is untouched). Those are the lane's failures,
    not the request's own, so they never count against MAX_RESUMES (the resume rule).
    """
    async with open_engine(str(tiny_model(LLAMA)), batch=1) as engine:
        undisturbed = (await engine.complete(PROMPTS[1], max_tokens=8)).token_ids
        results: dict[str, tuple[int, ...]] = {}

        async def long_row(started: trio.Event) -> None:
            ids: list[int] = []
            async for event in engine.generate(PROMPTS[0], max_tokens=120):
                if isinstance(event, TextDelta):
                    ids.extend(event.token_ids)
                    started.set()
            results["long"] = tuple(ids)

        async with trio.open_nursery() as nursery:
            started = trio.Event()
            nursery.start_soon(long_row, started)
            await started.wait()
            for _ in range(MAX_RESUMES + 3):
                engine.faults.arm("admission", "raise")
            results["queued"] = (await engine.complete(PROMPTS[1], max_tokens=8)).token_ids
        assert len(engine.faults.fired) == MAX_RESUMES + 3
        assert results["queued"] == undisturbed and len(results["long"]) > 0


class _LaneDyingAfterTheLastToken:
    """A lane that sends every token a request may have, then fails before saying it ended."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens
        self.submitted: list[Generate] = []

    def submit_nowait(self, command: Generate) -> None:
        self.submitted.append(command)
        command.reply.send_nowait(TokensDecoded(command.request_id, self.tokens[: command.params.max_tokens]))
        command.reply.close()  # no GenerationEnded: the session sees a lane failure


@pytest.mark.parametrize(("last", "reason"), [("max_tokens", "length"), ("eos", "stop")])
async def test_a_resume_after_the_last_token_finishes_without_generating_more(last: str, reason: str) -> None:
    """The lane dies after the request's last token (its max_tokens-th, or an EOS) but before it ends the
    request: the resumed attempt finishes there ("length" / "stop"), resubmitting nothing (before the fix
    it asked for max_tokens 0, and the lane always samples a token: the soak saw 18 of 16 tokens)."""
    async with open_engine(str(tiny_model(LLAMA)), batch=1) as engine:
        model = engine.model
        eos = min(model.eos_token_ids)
        tokens = (11, 12, 13, eos) if last == "eos" else (11, 12, 13, 14)
        request = engine.prepare(PROMPTS[0], max_tokens=6 if last == "eos" else 4)
        lane = _LaneDyingAfterTheLastToken(tokens)

        async def target() -> object:
            return lane

        events: list[object] = []
        previous: SessionActor | None = None
        for _ in range(2):
            send, recv = trio.open_memory_channel[object](0)
            previous = SessionActor(request, get_target=target, model=model, out=send, resume_from=previous)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(previous.run)
                async with recv:
                    events.extend([event async for event in recv])
            if isinstance(events[-1], Finished):
                break
    assert len(lane.submitted) == 1
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.finish_reason == reason
    assert finished.usage.completion_tokens == len(tokens)
    assert previous is not None and previous.generated == list(tokens)
