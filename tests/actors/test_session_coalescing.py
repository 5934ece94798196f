"""A session that falls behind its lane relays the tokens already waiting as one `TextDelta` (issue 20, point 4).

The fake lane below queues every event of a request before the session reads
any, as a decode actor does while the caller is busy: the session must merge
the waiting `TokensDecoded` into one delta, in order, with each token's
logprob, the right usage and stop-string handling, and never wait for more.
"""

from __future__ import annotations

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.actors.messages import Generate, GenerationEnded, TokensDecoded
from mlx_trio.actors.session import SessionActor
from mlx_trio.engine.model.text import TextStream
from mlx_trio.events import FinishReason, Finished, TextDelta
from mlx_trio.logprobs import SampledLogprobs
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.prompts import PROMPTS

TEXT = "The capital of France is Paris. It has a river and many bridges."


class _QueueingLane:
    """Sends all of a request's tokens at submit, `per_message` to a `TokensDecoded`, then (maybe) its end."""

    def __init__(self, tokens: list[int], *, per_message: int, logprobs: bool = False, end: bool = True) -> None:
        self.tokens, self.per_message, self.logprobs, self.end = tokens, per_message, logprobs, end

    def submit_nowait(self, command: Generate) -> None:
        for i in range(0, len(self.tokens), self.per_message):
            part = tuple(self.tokens[i:i + self.per_message])
            lps = tuple(SampledLogprobs(-0.5 - t / 1000, ((t, -0.5 - t / 1000), (t + 1, -3.0))) for t in part)
            command.reply.send_nowait(TokensDecoded(command.request_id, part, lps if self.logprobs else None,
                                                    proposed=2, accepted=1))
        if self.end:
            command.reply.send_nowait(GenerationEnded(command.request_id, FinishReason.LENGTH))
        command.reply.close()


async def _run(engine, lane: _QueueingLane, *, max_tokens: int | None = None,
               **params) -> tuple[list[object], SessionActor]:
    """One session over `lane`: every event it hands its caller, and the session."""
    request = engine.prepare(PROMPTS[0], max_tokens=max_tokens or len(lane.tokens), **params)

    async def target() -> object:
        return lane

    send, recv = trio.open_memory_channel[object](0)
    session = SessionActor(request, get_target=target, model=engine.model, out=send)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        async with recv:
            return [event async for event in recv], session


def _tokens(engine) -> list[int]:
    return list(engine.model.tokenizer.encode(TEXT, add_special_tokens=False))


def _reference_text(engine, tokens: list[int], stop: tuple[str, ...] = ()) -> tuple[str, int]:
    """The text token-at-a-time detokenizing shows, and how many tokens it took (to the stop string's end)."""
    text = TextStream(engine.model.detokenizer(), stop)
    shown = ""
    for n, token in enumerate(tokens, 1):
        update = text.add(token)
        shown += update.text
        if update.stopped:
            return shown, n
    return shown + text.finish().text, len(tokens)


@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
async def test_waiting_tokens_go_out_as_one_delta_in_order(logprobs: bool) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=1) as engine:
        tokens = _tokens(engine)
        assert len(tokens) >= 8
        events, _ = await _run(engine, _QueueingLane(tokens, per_message=3, logprobs=logprobs), logprobs=logprobs)
        expected_text, _ = _reference_text(engine, tokens)
        model = engine.model
    deltas = [e for e in events if isinstance(e, TextDelta)]
    # One delta for the tokens (all were waiting), maybe one more for the text the detokenizer held to the end.
    assert deltas[0].token_ids == tuple(tokens) and all(not d.token_ids for d in deltas[1:]) and len(deltas) <= 2
    assert "".join(d.text for d in deltas) == expected_text
    if logprobs:
        got = deltas[0].logprobs
        assert [lp.logprob for lp in got] == [-0.5 - t / 1000 for t in tokens]
        assert [lp.token for lp in got] == [model.token_bytes(t).decode("utf-8", errors="replace") for t in tokens]
        assert [[top.logprob for top in lp.top_logprobs] for lp in got] == [[-0.5 - t / 1000, -3.0] for t in tokens]
    else:
        assert deltas[0].logprobs == ()
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.finish_reason == "length"
    messages = -(-len(tokens) // 3)
    assert finished.usage.completion_tokens == len(tokens)
    assert (finished.usage.speculative_proposed, finished.usage.speculative_accepted) == (2 * messages, messages)


async def test_a_stop_string_spanning_coalesced_messages_cuts_there() -> None:
    """The stop string starts in one lane message and ends in the next: text before it only, usage to its token."""
    async with open_engine(str(tiny_model(LLAMA)), batch=1) as engine:
        tokens = _tokens(engine)
        stop = ("Paris.",)
        expected_text, used = _reference_text(engine, tokens, stop)
        assert used < len(tokens) and expected_text == TEXT[:TEXT.index("Paris.")]
        events, _ = await _run(engine, _QueueingLane(tokens, per_message=2), stop=list(stop))
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert len(deltas) == 1 and deltas[0].token_ids == tuple(tokens[:used]) and deltas[0].text == expected_text
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.finish_reason == "stop" and finished.stop_sequence == "Paris."
    assert finished.usage.completion_tokens == used


async def test_a_lane_that_fails_after_queued_tokens_still_relays_them_first() -> None:
    """No GenerationEnded: the waiting tokens are relayed (merged), then the attempt reports the lane failure."""
    async with open_engine(str(tiny_model(LLAMA)), batch=1) as engine:
        tokens = _tokens(engine)[:6]
        events, session = await _run(engine, _QueueingLane(tokens, per_message=2, end=False), max_tokens=20)
    assert [e.token_ids for e in events if isinstance(e, TextDelta)] == [tuple(tokens)]
    assert session.generated == tokens and session.failure is not None
