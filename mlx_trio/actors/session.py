"""The session actor: one attempt at a request, a temporary child of the sessions supervisor.

It submits the request to the lane, turns token ids into text (stop
strings included) and usage, and forwards events to the caller. Ending it
(the caller went away, or a stop string matched) closes its end of the reply
channel; the lane actor holding the request notices at its next send, drops
the request and frees its KV cache.

Per lane message, not per token: a decode message's tokens are detokenized
together and relayed as one `TextDelta`, and the messages that queued while
the caller was busy are merged into it first (`_coalesced`), so a stream
that falls behind catches up in one SSE event instead of one per step.

Resume: a session holds the prompt ids and every token id received so far.
If the lane fails under it (an actor crashed and is being restarted) it
ends without `Finished`, and so does a session that crashes itself; the
caller's stream (`Engine.stream`, the one resume loop) then starts a new
session from this one's state (`resume_from`). That one waits for a
healthy lane and re-submits prompt + received tokens as the new prompt,
`max_tokens` reduced by what it already has and the random draws already
made skipped, so the caller sees one uninterrupted stream: the detokenizer
and the stop-string matcher simply carry on.

Replay: a request that an earlier *process* began (a front process resumes
it once the engine that ran it is gone, its process or its scale-out group:
link/remote_engine.py) comes with the tokens that process generated, as the chunks they were sent
in (`replay`). The first session relays them as if the lane had just sent
them, one `TextDelta` per chunk, through the same detokenizer and stop-string
matcher, then goes on as a resumed attempt (prompt + those tokens
re-prefilled, their random draws skipped), so every event after them is the
one the first process would have sent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from mlx_trio.actors.messages import DecodeEvent, Generate, GenerationEnded, PrefillProgressed, Request, TokensDecoded
from mlx_trio.engine.model.text import TextStream
from mlx_trio.errors import ActorCrashed, MlxTrioError, Overloaded, RequestError
from mlx_trio.events import FinishReason, Finished, GenerationEvent, PromptProgress, TextDelta, Usage
from mlx_trio.logprobs import SampledLogprobs, TokenLogprob, TopLogprob
from mlx_trio.supervision.faults import Faults

log = logging.getLogger("mlx_trio.session")

# What a session hands its caller: events, or the error that ended the request.
SessionOutput = GenerationEvent | MlxTrioError
# Awaits a healthy engine and returns what takes requests (submit_nowait(Generate)).
GetTarget = Callable[[], Awaitable[object]]


@attrs.frozen
class SessionStatistics:
    request_id: str
    mailbox_depth: int
    prompt_tokens: int
    completion_tokens: int
    resumes: int


class SessionActor:
    """Drives one attempt at a request: to `Finished`, to an error for the caller, or to a lane failure.

    `failure` says why an attempt ended without `Finished` or an error (the
    lane failed under it); None while it runs or if it crashed itself.
    `own_failure` is True when that failure was this request's alone (the
    lane said so: its own prefill failed), False when the lane failed under it.
    """

    def __init__(self, request: Request, *, get_target: GetTarget, model: object,
                 out: trio.MemorySendChannel[SessionOutput], faults: Faults | None = None,
                 resume_from: SessionActor | None = None, delay_s: float = 0.0,
                 replay: Sequence[Sequence[int]] = ()) -> None:
        # `model` has detokenizer() and eos_token_ids. `resume_from` is an earlier attempt at
        # the same request that ended without `Finished`: this one carries on from its state,
        # after `delay_s` (inside the actor, so a stopping engine cancels the wait with it).
        # `replay` (a first attempt only): an earlier process's tokens, relayed first (see above).
        assert not (replay and resume_from is not None)
        self._delay_s = delay_s
        self._replay = tuple(tuple(chunk) for chunk in replay)
        self._request = request
        self._get_target = get_target
        self._model = model
        self._out = out
        self._faults = faults or Faults()
        self._id = f"session-{request.request_id}"
        self._replies: trio.MemoryReceiveChannel[DecodeEvent] | None = None
        if resume_from is None:
            self._text = TextStream(model.detokenizer(), request.params.stop)  # type: ignore[attr-defined]
            # Every token id received from the engine, in order (EOS included): with the
            # prompt ids, exactly what a resumed attempt must re-feed.
            self.generated: list[int] = []
            self.resumes = 0
            self.cached_tokens = 0  # prompt tokens the first attempt took from the prompt cache
            self.speculative = [0, 0]  # proposals verified and accepted, over every attempt
        else:
            self._text = resume_from._text
            self.generated = resume_from.generated
            self.resumes = resume_from.resumes + 1
            self.cached_tokens = resume_from.cached_tokens
            self.speculative = resume_from.speculative
        # What this session started from: a crash with nothing added is a resume that stalled.
        self.generated_at_start = len(self.generated)
        self.failure: BaseException | None = None
        self.own_failure = False
        self._scope = trio.CancelScope()

    def statistics(self) -> SessionStatistics:
        replies = self._replies
        return SessionStatistics(
            request_id=self._request.request_id,
            mailbox_depth=replies.statistics().current_buffer_used if replies is not None else 0,
            prompt_tokens=len(self._request.prompt_ids),
            completion_tokens=len(self.generated),
            resumes=self.resumes,
        )

    async def run(self, *, task_status: trio.TaskStatus[SessionActor] = trio.TASK_STATUS_IGNORED) -> None:
        """Relay the attempt to the caller; closing `out` without `Finished` or an error asks for a resume."""
        async with self._out:
            task_status.started(self)
            with self._scope:
                try:
                    await trio.sleep(self._delay_s)
                    if not await self._replayed(self._text):
                        self.failure = await self._attempt(self._text)
                except MlxTrioError as exc:
                    await self._out.send(exc)
                except trio.BrokenResourceError:
                    log.debug("request %s: caller went away", self._request.request_id)

    def cancel(self) -> None:
        """The caller went away: end now, closing the reply channel, not at the next event.

        The lane actor holding the request sees the closed channel before its
        next prefill chunk or decode step, and frees the row (issue #19: a
        dropped request stops at the next chunk). Idempotent; harmless once ended.
        """
        self._scope.cancel()

    async def _replayed(self, text: TextStream) -> bool:
        """Relay `replay`'s chunks as the lane's messages would be; True if that ended the request (a stop string)."""
        eos = self._model.eos_token_ids  # type: ignore[attr-defined]
        for chunk in self._replay:
            if await self._tokens(chunk, None, text, eos):
                return True
        self._replay = ()
        return False

    async def _attempt(self, text: TextStream) -> BaseException | None:
        """Submit what remains of the request and relay it to the end; returns why the lane failed, if it did.

        A resumed request may have nothing left: the lane failed after sending
        its last token (max_tokens reached, or an EOS) but before it said the
        generation ended. It then finishes here, as the lane would have; a
        resubmission would generate past the end (the lane always samples at
        least one token, so `max_tokens` 0 means more than nothing).
        """
        request, done = self._request, len(self.generated)
        eos = self._model.eos_token_ids  # type: ignore[attr-defined]
        if done and (self.generated[-1] in eos or done >= request.params.max_tokens):
            # The decoder's order: an EOS ends with "stop" even when it is also the last allowed token.
            await self._end(text, FinishReason.STOP if self.generated[-1] in eos else FinishReason.LENGTH)
            return None
        target = await self._get_target()
        send, self._replies = trio.open_memory_channel[DecodeEvent](
            # Every event a request can produce fits, so the decoder never blocks on a slow client.
            request.params.max_tokens + len(request.prompt_ids) + done + 4
        )
        command = Generate(
            # A resumed attempt under an id of its own: the lane may still hold the last attempt's row (it lets go
            # at its next step), and the lane keys rows, reservations and cache puts by id.
            request.request_id if not self.resumes else f"{request.request_id}.{self.resumes}",
            request.prompt_ids + tuple(self.generated),
            attrs.evolve(request.params, max_tokens=request.params.max_tokens - done),
            send, rng_draws=done, resumed_tokens=done, snapshot_at=request.snapshot_at, adapter=request.adapter,
        )
        with self._replies:
            try:
                target.submit_nowait(command)  # type: ignore[attr-defined]
            except (RequestError, Overloaded):
                send.close()  # never submitted: no lane actor holds it, so the session closes it
                raise
            except MlxTrioError as exc:
                send.close()
                return exc
            return await self._relay(self._replies, text, offset=done)

    async def _relay(self, replies: trio.MemoryReceiveChannel[DecodeEvent], text: TextStream, *,
                     offset: int) -> BaseException | None:
        async for first in replies:
            for event in _coalesced(first, replies):
                # Before the event changes any state: a crash here loses nothing a resume can't redo.
                self._faults.check(self._id)
                ended = await self._handle(event, text, offset=offset)
                if ended is not _RUNNING:
                    return ended
        # The channel closed without a GenerationEnded: the lane failed mid-request.
        return ActorCrashed("the lane stopped before the request finished")

    async def _handle(self, event: DecodeEvent, text: TextStream, *, offset: int) -> object:
        """Relay one lane event; `_RUNNING` while the request goes on, else what `_relay` returns."""
        if isinstance(event, PrefillProgressed):
            if not offset:  # a resumed attempt's re-prefill is invisible to the caller
                total = len(self._request.prompt_ids)
                self.cached_tokens = event.cached_tokens
                await self._emit(PromptProgress(min(event.processed, total), total))
        elif isinstance(event, TokensDecoded):
            self.speculative[0] += event.proposed
            self.speculative[1] += event.accepted
            eos = self._model.eos_token_ids  # type: ignore[attr-defined]
            if await self._tokens(event.token_ids, event.logprobs, text, eos):
                return None
        elif isinstance(event, GenerationEnded):
            if event.reason == FinishReason.ERROR:
                error = event.error
                if isinstance(error, (RequestError, Overloaded)):
                    # The caller's to see: bad input, or no room now (a 503 with Retry-After), not a lane failure.
                    raise error
                self.own_failure = event.own
                return error if error is not None else ActorCrashed("unknown error")
            await self._end(text, event.reason)
            return None
        return _RUNNING

    async def _end(self, text: TextStream, reason: FinishReason) -> None:
        """The generation ended (`reason`): the text the detokenizer held back, then `Finished`."""
        tail = text.finish()
        if tail.text:
            await self._emit(TextDelta(tail.text, ()))
        await self._finish(reason)

    async def _tokens(self, token_ids: tuple[int, ...], logprobs: tuple[SampledLogprobs, ...] | None,
                      text: TextStream, eos: frozenset[int]) -> bool:
        """Relay new tokens; True when a stop string ended the request."""
        if logprobs is None and text.batches:  # no stop string, no logprobs: the whole message at once
            self.generated.extend(token_ids)
            shown = tuple(token for token in token_ids if token not in eos)  # EOS counted, never shown
            piece = text.add_many(shown)
            if shown or piece:
                await self._emit(TextDelta(piece, shown))
            return False
        visible: list[int] = []
        visible_logprobs: list[TokenLogprob] = []
        pieces: list[str] = []
        stopped: str | None = None
        for i, token in enumerate(token_ids):
            self.generated.append(token)
            if token in eos:
                continue  # counted (as mlx_lm.server does) but never shown
            visible.append(token)
            if logprobs is not None:
                visible_logprobs.append(self._token_logprob(token, logprobs[i]))
            update = text.add(token)
            pieces.append(update.text)
            if update.stopped:
                stopped = update.stop
                break
        if visible or any(pieces):
            await self._emit(TextDelta("".join(pieces), tuple(visible), tuple(visible_logprobs)))
        if stopped is not None:
            await self._finish(FinishReason.STOP, stop_sequence=stopped)
        return stopped is not None

    async def _emit(self, event: SessionOutput) -> None:
        """Hand `event` to the caller (a rendezvous: the session waits for it).

        The caller is usually already waiting in `receive`: then `send_nowait`
        hands it over without a trip through the scheduler, which `send`
        always takes (once per token per row; the `replies` receive of the
        same turn is its checkpoint). Otherwise wait for the caller.
        """
        try:
            self._out.send_nowait(event)
        except trio.WouldBlock:
            await self._out.send(event)

    def _token_logprob(self, token: int, sampled: SampledLogprobs) -> TokenLogprob:
        """The engine's ids and floats, with each token's text and bytes (the tokenizer is ours)."""
        def shown(token_id: int) -> tuple[str, tuple[int, ...]]:
            raw = self._model.token_bytes(token_id)  # type: ignore[attr-defined]
            return raw.decode("utf-8", errors="replace"), tuple(raw)

        top = tuple(TopLogprob(*shown(tid), lp) for tid, lp in sampled.top)
        return TokenLogprob(*shown(token), sampled.logprob, top)

    async def _finish(self, reason: FinishReason, *, stop_sequence: str | None = None) -> None:
        usage = Usage(prompt_tokens=len(self._request.prompt_ids), completion_tokens=len(self.generated),
                      cached_tokens=self.cached_tokens, speculative_proposed=self.speculative[0],
                      speculative_accepted=self.speculative[1])
        await self._emit(Finished(reason, usage, stop_sequence))


_RUNNING = object()  # what `SessionActor._handle` returns while the request goes on


def _coalesced(first: DecodeEvent, replies: trio.MemoryReceiveChannel[DecodeEvent]) -> list[DecodeEvent]:
    """`first` and the events already waiting behind it, with consecutive `TokensDecoded` merged into one.

    Why: when the caller falls behind (a slow client, a busy event loop),
    decode steps queue up in `replies`; relaying them as one `TextDelta`
    makes one SSE event, not one per step. Only what has already arrived is
    taken (`receive_nowait`): no token ever waits for more. The merge keeps
    order, and the logprobs and speculative counts of every part.
    """
    events: list[DecodeEvent] = [first]
    while isinstance(events[-1], TokensDecoded):
        try:
            nxt = replies.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            break  # nothing more yet; a closed channel ends `_relay`'s loop at its next receive
        last = events[-1]
        if isinstance(nxt, TokensDecoded) and (last.logprobs is None) == (nxt.logprobs is None):
            events[-1] = TokensDecoded(
                last.request_id, last.token_ids + nxt.token_ids,
                None if last.logprobs is None else last.logprobs + nxt.logprobs,  # type: ignore[operator]
                last.proposed + nxt.proposed, last.accepted + nxt.accepted)
        else:
            events.append(nxt)
    return events
