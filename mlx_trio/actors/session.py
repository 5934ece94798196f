"""The session actor: one per request, a temporary child of the sessions supervisor.

It submits the request to the decoder, turns token ids into text (stop
strings included) and usage, and forwards events to the caller. Ending it
(the caller went away, or a stop string matched) closes its channel from the
decoder, which drops the request and frees its KV cache at the next token.
"""

from __future__ import annotations

import logging

import attrs
import trio

from mlx_trio.actors.messages import DecodeEvent, Generate, GenerationEnded, PrefillProgressed, TokensDecoded
from mlx_trio.engine.text import TextStream
from mlx_trio.errors import ActorCrashed, MlxTrioError
from mlx_trio.events import Finished, GenerationEvent, PromptProgress, TextDelta, Usage
from mlx_trio.params import SamplingParams

log = logging.getLogger("mlx_trio.session")

# What a session hands its caller: events, or the error that ended the request.
SessionOutput = GenerationEvent | MlxTrioError


@attrs.frozen
class Request:
    """A validated, tokenized request, ready for the engine."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@attrs.frozen
class SessionStatistics:
    request_id: str
    mailbox_depth: int
    prompt_tokens: int
    completion_tokens: int


class SessionActor:
    """Drives one request from submission to `Finished` (or an error)."""

    def __init__(self, request: Request, *, decoder: object, model: object,
                 out: trio.MemorySendChannel[SessionOutput]) -> None:
        # `decoder` has submit_nowait(Generate); `model` has detokenizer() and eos_token_ids.
        self._request = request
        self._decoder = decoder
        self._model = model
        self._out = out
        # Every event a request can produce fits, so the decoder never blocks on a slow client.
        buffer = request.params.max_tokens + len(request.prompt_ids) + 4
        self._reply_send, self._replies = trio.open_memory_channel[DecodeEvent](buffer)
        self._completion_tokens = 0
        # Every token id sent to the caller, in order: with the prompt ids, what a
        # resumed generation needs to pick up exactly where this one stands.
        self.delivered: list[int] = []

    def statistics(self) -> SessionStatistics:
        return SessionStatistics(
            request_id=self._request.request_id,
            mailbox_depth=self._replies.statistics().current_buffer_used,
            prompt_tokens=len(self._request.prompt_ids),
            completion_tokens=self._completion_tokens,
        )

    async def run(self, *, task_status: trio.TaskStatus[SessionActor] = trio.TASK_STATUS_IGNORED) -> None:
        request = self._request
        async with self._out, self._replies:
            try:
                self._decoder.submit_nowait(  # type: ignore[attr-defined]
                    Generate(request.request_id, request.prompt_ids, request.params, self._reply_send)
                )
            except MlxTrioError as exc:
                self._reply_send.close()
                task_status.started(self)
                await self._deliver(exc)
                return
            task_status.started(self)
            try:
                await self._relay()
            except trio.BrokenResourceError:
                log.debug("request %s: caller went away", request.request_id)

    async def _relay(self) -> None:
        text = TextStream(self._model.detokenizer(), self._request.params.stop)  # type: ignore[attr-defined]
        eos = self._model.eos_token_ids  # type: ignore[attr-defined]
        async for event in self._replies:
            if isinstance(event, PrefillProgressed):
                await self._out.send(PromptProgress(event.processed, event.total))
            elif isinstance(event, TokensDecoded):
                visible: list[int] = []
                pieces: list[str] = []
                stopped = False
                for token in event.token_ids:
                    self._completion_tokens += 1
                    if token in eos:
                        continue  # counted (as mlx_lm.server does) but never shown
                    visible.append(token)
                    update = text.add(token)
                    pieces.append(update.text)
                    if update.stopped:
                        stopped = True
                        break
                if visible or any(pieces):
                    await self._out.send(TextDelta("".join(pieces), tuple(visible)))
                    self.delivered.extend(visible)
                if stopped:
                    await self._finish("stop")
                    return
            elif isinstance(event, GenerationEnded):
                if event.reason == "error":
                    error = event.error
                    await self._deliver(error if isinstance(error, MlxTrioError)
                                        else ActorCrashed(f"generation failed: {error!r}"))
                    return
                tail = text.finish()
                if tail.text:
                    await self._out.send(TextDelta(tail.text, ()))
                await self._finish(event.reason)
                return
        # The decoder closed our channel without a GenerationEnded: it died mid-request.
        await self._deliver(ActorCrashed("the decoder stopped before the request finished"))

    async def _finish(self, reason: str) -> None:
        usage = Usage(prompt_tokens=len(self._request.prompt_ids), completion_tokens=self._completion_tokens)
        await self._out.send(Finished(reason, usage))

    async def _deliver(self, error: MlxTrioError) -> None:
        await self._out.send(error)
