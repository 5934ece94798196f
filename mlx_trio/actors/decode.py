"""The serial decode actor: one request at a time, in lease-sized jobs.

This is the `--batch 1` determinism pin: a request's bits never depend on
what else is in flight, because nothing else is. Requests queue FIFO in the
inbox. Each prefill chunk and each token is one GPU-lease job, so the Trio
side stays responsive and a cancelled request is dropped within one token.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import trio

from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.actors.messages import DecodeEvent, Generate, close_replies, GenerationEnded, PrefillProgressed, TokensDecoded
from mlx_trio.engine.model.load import LoadedModel
from mlx_trio.engine.serial import SerialGeneration
from mlx_trio.errors import LeaseClosed, Overloaded
from mlx_trio.supervision.faults import Faults, InjectedFault

log = logging.getLogger("mlx_trio.decode")


@attrs.frozen
class DecodeStatistics:
    mailbox_depth: int
    active_request: str | None
    active_kv_bytes: int
    submitted: int
    requests_done: int
    requests_cancelled: int
    requests_failed: int
    tokens_decoded: int


class SerialDecodeActor:
    """Owns the running request's KV cache; everything MLX goes through the lease."""

    def __init__(self, lease: GpuLease, get_model: Callable[[], Awaitable[LoadedModel]], *,
                 max_queue: int = 256, prefill_step_size: int = 2048, faults: Faults | None = None) -> None:
        # The model may still be loading when the actor starts: requests queue until it is.
        self._lease = lease
        self._get_model = get_model
        self._faults = faults or Faults()
        self._prefill_step_size = prefill_step_size
        # Bounded: a full inbox is backpressure the caller turns into 503 + Retry-After.
        self._send, self._inbox = trio.open_memory_channel[Generate](max_queue)
        self._active: Generate | None = None
        self._active_gen: SerialGeneration | None = None
        self._done = self._cancelled = self._failed = self._tokens = self._submitted = 0

    def submit_nowait(self, cmd: Generate) -> None:
        """Queue a request; raises `Overloaded` when the inbox is full."""
        try:
            self._send.send_nowait(cmd)
            self._submitted += 1
        except trio.WouldBlock:
            raise Overloaded("the decode queue is full; retry shortly") from None
        except trio.ClosedResourceError:
            raise LeaseClosed("the decoder is stopping") from None

    def statistics(self) -> DecodeStatistics:
        gen = self._active_gen
        return DecodeStatistics(
            mailbox_depth=self._inbox.statistics().current_buffer_used,
            active_request=self._active.request_id if self._active else None,
            active_kv_bytes=gen.nbytes if gen is not None else 0,
            submitted=self._submitted,
            requests_done=self._done,
            requests_cancelled=self._cancelled,
            requests_failed=self._failed,
            tokens_decoded=self._tokens,
        )

    async def run(self, *, task_status: trio.TaskStatus[SerialDecodeActor] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        try:
            self._model = await self._get_model()
            async for cmd in self._inbox:
                await self._serve(cmd)
        finally:
            self._send.close()
            close_replies(self._inbox)

    async def _serve(self, cmd: Generate) -> None:
        self._active = cmd
        gen: SerialGeneration | None = None
        with cmd.reply:
            try:
                gen = await self._lease.run(partial(
                    SerialGeneration, self._model.model, cmd.prompt_ids, cmd.params,
                    prefill_step_size=self._prefill_step_size, rng_draws=cmd.rng_draws,
                    grammar_tokenizer=self._model.grammar_tokenizer, resumed_tokens=cmd.resumed_tokens,
                ))
                self._active_gen = gen
                await self._generate(cmd, gen)
                self._done += 1
            except trio.BrokenResourceError:
                # The session closed its end: the client went away. Not an error.
                self._cancelled += 1
            except (LeaseClosed, InjectedFault):
                raise
            except Exception as exc:
                # A per-request failure must not take the actor (and the queue) down.
                self._failed += 1
                log.exception("request %s failed", cmd.request_id)
                _emit_quietly(cmd.reply, GenerationEnded(cmd.request_id, "error", exc))
            finally:
                self._active = self._active_gen = None
                if gen is not None:
                    self._lease.free_nowait(gen.close)

    async def _generate(self, cmd: Generate, gen: SerialGeneration) -> None:
        rid, total = cmd.request_id, len(cmd.prompt_ids)
        cmd.reply.send_nowait(PrefillProgressed(rid, 0, total))
        while gen.prefill_remaining:
            remaining = await self._lease.run(gen.prefill_chunk)
            cmd.reply.send_nowait(PrefillProgressed(rid, total - 1 - remaining, total))
        reason = "length"
        for _ in range(cmd.params.max_tokens):
            self._faults.check("decode-step")
            token, logprobs = await self._lease.run(gen.step_decoded)
            self._tokens += 1
            cmd.reply.send_nowait(TokensDecoded(rid, (token,), (logprobs,) if logprobs is not None else None))
            if token in self._model.eos_token_ids:
                reason = "stop"
                break
        cmd.reply.send_nowait(GenerationEnded(rid, reason))


def _emit_quietly(reply: trio.MemorySendChannel[DecodeEvent], event: DecodeEvent) -> None:
    try:
        reply.send_nowait(event)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        pass
