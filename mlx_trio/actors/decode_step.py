"""The decode-step actor of the batch lane: owns the running batch (docs/design.md §3, §4).

Each loop turn: settle membership if rows want to join or leave (flush the
pipeline, filter finished rows out, join prefilled rows: adopt into an empty
batch, extend or merge otherwise), then decode until membership must change:
a chain of pipelined step jobs that the lease thread queues itself. It
reports each job's tokens to Trio before it launches the job's last step,
and they go to each row's session from there; a row finishes on EOS or
max_tokens, or leaves when its session went away, and either stops the
chain, as does a row waiting to join.

A failed step fails every row of the batch with a typed error and then
re-raises, so the supervisor restarts this actor with an empty batch.
Every row ends through `Lane.end_request`: its last event goes out when it
finishes, its reply is closed and its reservation released when it leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import attrs
import trio

from mlx_trio.actors.gpu_lease import GpuLease, LeaseChain
from mlx_trio.actors.lane import Lane
from mlx_trio.actors.memory_budget import out_of_memory
from mlx_trio.actors.messages import GenerationEnded, Generate, JoinRow, TokensDecoded, drain_nowait
from mlx_trio.config import EngineConfig
from mlx_trio.engine.batch.decode_batch import DecodeBatch, Decoded
from mlx_trio.engine.model.load import LoadedModel
from mlx_trio.engine.speculative.speculator import SpeculationConfig
from mlx_trio.errors import ActorCrashed
from mlx_trio.events import FinishReason
from mlx_trio.engine.spans import span

log = logging.getLogger("mlx_trio.decode_step")

# Step jobs whose tokens may wait for Trio before the step chain ends (see DecodeStepActor._run_steps).
MAX_UNHANDLED_REPORTS = 2


def steps_per_job(rows: int) -> int:
    """Decode steps one lease job runs for a batch of `rows`.

    The Trio side costs tens of µs of CPU per token and row (emit, session,
    caller), and it competes for the GIL with the lease thread building the
    next step: at B=64 that was as much as the step itself on an H200.
    Several steps per job hand each row its tokens in one message, so that
    cost is paid once per job: at B=8 (tiny llama, this box, 400 tokens per
    row) 2 steps per job took Trio-thread CPU from 37 to 26 µs per token and
    task steps from 2.3 to 1.2 per token. Smaller batches keep one step per
    job (tokens stream one by one).
    """
    return 1 if rows < 8 else 2 if rows < 48 else 4


# A batched row's KV is copied out for the prompt cache only when its prompt is this long.
EXTRACT_MIN_PROMPT_TOKENS = 256


@attrs.define
class RunningRow:
    """Trio-side record of one row in the batch (its arrays live in DecodeBatch)."""

    request: Generate
    generated: list[int]  # token ids already sent, token 0 included
    done: bool = False
    # Speculative proposals of this row the target verified / accepted (0 / 0 when it never speculated).
    proposed: int = 0
    accepted: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.generated)


@attrs.frozen
class DecodeStepStatistics:
    mailbox_depth: int
    active_rows: int
    kv_bytes: int
    steps: int
    # Step chains started: one per membership change, plus one each time Trio fell behind (see _run_steps).
    chains: int
    tokens_decoded: int
    finished: int
    cancelled: int
    # Model forwards of decode steps (a speculative step is one), and speculative proposals / acceptances.
    decode_steps: int = 0
    proposed: int = 0
    accepted: int = 0


class DecodeStepActor:
    """Runs the continuous batch; every MLX call goes through the lease."""

    def __init__(self, lane: Lane, lease: GpuLease) -> None:
        self._lane = lane
        self._lease = lease
        self._faults = lane.faults
        # Prefill hands over at most --batch rows at a time (admission's cap; under auto, not known yet).
        self.join_send, self._joins = trio.open_memory_channel[JoinRow](lane.row_bound)
        self._batch: DecodeBatch | None = None
        self._rows: dict[str, RunningRow] = {}
        # Joins taken from the channel but not yet in the batch: a failure in between must
        # still end them (their sessions resume), or they would wait forever.
        self._joining: list[JoinRow] = []
        # The running step chain (see _run_steps); reports sent by the lease thread, handled by Trio.
        self._chain: LeaseChain | None = None
        self._reports_sent = self._reports_handled = 0
        self._kv_bytes = 0
        self._steps = self._chains = self._tokens = self._finished = self._cancelled = 0
        self._forwards = self._proposed = self._accepted = 0
        # What `_emit_reported` raised in Trio's run loop, re-raised in this actor's task.
        self._reported_error: BaseException | None = None

    @property
    def decoding(self) -> bool:
        """Whether rows are in the batch (decoding, or finished and about to leave)."""
        return bool(self._rows)

    @property
    def num_rows(self) -> int:
        """Rows in the batch (decoding, or finished and about to leave)."""
        return len(self._rows)

    def in_flight(self) -> list[Generate]:
        """Requests holding a row here (running or waiting to join)."""
        return [row.request for row in self._rows.values()]

    def statistics(self) -> DecodeStepStatistics:
        return DecodeStepStatistics(
            mailbox_depth=self._joins.statistics().current_buffer_used, active_rows=len(self._rows),
            kv_bytes=self._kv_bytes, steps=self._steps, chains=self._chains, tokens_decoded=self._tokens,
            finished=self._finished, cancelled=self._cancelled, decode_steps=self._forwards,
            proposed=self._proposed, accepted=self._accepted,
        )

    async def run(self, *, task_status: trio.TaskStatus[DecodeStepActor] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        try:
            self._model = await self._lane.wait_model()
            self._batch = await self._lease.run(partial(DecodeBatch, self._model.model, self._model.kv_scheme,
                                                        speculation_for(self._lane.config, self._lane.model),
                                                        compile_decode=self._model.compile_decode,
                                                        max_rows=self._lane.row_cap,
                                                        paged=self._model.paged_kv))
            while True:
                if not self._rows:
                    # Idle: sleep until a row arrives (no busy loop, no lease jobs); it joins with every row
                    # already sent behind it (a cohort's), in one settle.
                    first = await self._joins.receive()
                    await self._settle([first, *drain_nowait(self._joins)])
                else:
                    await self._settle(drain_nowait(self._joins))
                if self._rows:
                    self._faults.check("decode-step")
                    await self._run_steps()
        except BaseException as exc:
            self._fail_all(exc)
            raise
        finally:
            self.join_send.close()
            for join in drain_nowait(self._joins):
                self._lane.end_request(join.request, _failed(join.request, ActorCrashed("the decoder stopped")),
                                       row=join.row)
            if self._batch is not None:
                self._lease.free_nowait(self._batch.close)

    async def _settle(self, joins: list[JoinRow]) -> None:
        """Change membership: flush the pipeline, drop finished rows, join new ones, in one lease job.

        One job (`_membership`) rather than one per flush, prompt-cache put,
        leave and join: each would be a hop to Trio and back with the lease
        idle, a settle every couple of steps under a serving load
        (docs/lab-notes/2026-12-01-serving-churn.md). The rows that leave are those done before it;
        a row that the flushed tokens finish leaves in a second (leave-only)
        job right after, before any step feeds it again.
        """
        batch = self._batch
        assert batch is not None
        self._joining = list(joins)
        leaving = [rid for rid, row in self._rows.items() if row.done]
        if not joins and not leaving:
            return
        ids = batch.request_ids
        # One join for every waiting row: the running rows' KV is copied once at most, not once per joiner.
        decoded = await self._change_membership(leaving, [(join.row, join.token0) for join in self._joining])
        for join in self._joining:
            self._rows[join.request.request_id] = RunningRow(join.request, generated=[join.token0])
        self._joining = []
        if decoded is not None:
            self._emit(ids, [decoded])  # rows that left are gone: their wasted tokens are dropped
        finished = [rid for rid, row in self._rows.items() if row.done]
        if finished:
            await self._change_membership(finished, [])
        self._kv_bytes = batch.nbytes

    async def _change_membership(self, leaving: list[str], joiners: list[tuple[Any, int]]) -> Decoded | None:
        """One `_membership` lease job: the leavers' prompt-cache puts, leave, join; end the leavers.

        Returns the tokens the job flushed (batch order from before it), or None.
        """
        puts = self._puts(leaving)
        decoded, entries = await self._lease.run(_membership, self._batch, leaving,
                                                 [(rid, tokens) for rid, tokens, _ in puts], joiners)
        for (_, _, caching), entry in zip(puts, entries, strict=True):
            if entry is not None:
                caching.store(entry)
        for rid in leaving:
            self._lane.end_request(self._rows.pop(rid).request)
        return decoded

    def _puts(self, leaving: list[str]) -> list[tuple[str, tuple[int, ...], Any]]:
        """Finish-time put (docs/design.md §6.3): the leaving rows whose KV goes to the prompt cache.

        (request id, its tokens, the prompt cache) each: a lone row hands its
        caches over without a copy; a batched row with a long enough prompt is
        extracted before the leave drops it.
        """
        batch = self._batch
        if self._lane.caching is None or batch is None:
            return []
        puts = []
        for rid in leaving:
            row = self._rows[rid]
            caching = self._lane.caching_for(row.request)  # a row with an adapter: its namespace
            if caching is None or not (batch.is_solo or len(row.request.prompt_ids) >= EXTRACT_MIN_PROMPT_TOKENS):
                continue
            puts.append((rid, row.request.prompt_ids + tuple(row.generated), caching))
        return puts

    async def _run_steps(self) -> None:
        """Decode until membership must change: a lease chain of step jobs (`GpuLease.chain`).

        The lease thread queues each next step job itself, so it never idles
        across a hop to Trio and back (waking this actor, emitting, waking
        sessions and callers: 0.4-1.1 ms per step on an H200,
        docs/lab-notes/), and this actor is not woken per job at all.

        A job's tokens reach Trio before the job's last step is launched: the
        lease thread reports them (`DecodeBatch.steps_decoded`) and
        `_emit_reported` hands them to the sessions from Trio's run loop. So
        the sessions run while the lease thread waits in `async_eval` with the
        GIL released, not while it builds the next graph (H200, B=64,
        interleaved pairs: 0.68 of the bare loop before, 0.82-0.87 after;
        docs/lab-notes/). `_emit_reported` stops the chain when a row
        finishes or leaves, a join waits, or emitting failed; the lease thread
        ends it when `MAX_UNHANDLED_REPORTS` reports wait for Trio, so a busy
        Trio thread bounds how far the batch runs ahead of its sessions (a
        finished row is fed at most that many jobs' tokens more, whose outputs
        are dropped).
        """
        batch = self._batch
        assert batch is not None
        ids = list(batch.request_ids)
        report = partial(self._report, ids)
        chain = self._lease.chain(_steps_then, batch, steps_per_job(len(ids)), report, self._trio_keeps_up)
        self._chain = chain
        self._chains += 1
        try:
            await chain.wait()
        finally:
            chain.stop()
            self._chain = None
        if self._reported_error is not None:
            raise self._reported_error
        self._kv_bytes = batch.nbytes

    def _trio_keeps_up(self) -> bool:
        """On the lease thread, after a link's steps: False ends the chain (Trio is behind)."""
        return self._reports_sent - self._reports_handled < MAX_UNHANDLED_REPORTS

    def _report(self, request_ids: list[str], steps: list[Decoded]) -> None:
        """On the lease thread: these consecutive steps' tokens go to `_emit_reported` in Trio's run loop."""
        self._reports_sent += 1
        self._lease.to_trio_soon(self._emit_reported, request_ids, steps)

    def _emit_reported(self, request_ids: list[str], steps: list[Decoded]) -> None:
        """`_emit` of a job's tokens, run by the lease in Trio's run loop: it must not raise.

        Stops the step chain when membership must change; an error is kept
        for `_run_steps` to re-raise in the actor's task.
        """
        self._reports_handled += 1
        chain = self._chain
        if chain is None or self._reported_error is not None:
            return  # a report of a chain this actor no longer waits for: it failed or was cancelled
        self._steps += sum(d.forwards for d in steps)
        try:
            ended = self._emit(request_ids, steps)
            self._faults.check("decode-step")
        except BaseException as exc:  # noqa: BLE001 - re-raised in the actor's task by _run_steps
            self._reported_error = exc
            ended = True
        if ended or self._joins.statistics().current_buffer_used:
            chain.stop()

    def _emit(self, request_ids: list[str], steps: Sequence[Decoded]) -> bool:
        """Send each row its tokens of these consecutive steps as one message; end the rows that finish.

        Returns whether a row finished or its session went away (it must leave the batch).
        """
        eos = self._model.eos_token_ids
        ended = False
        for decoded in steps:
            self._forwards += decoded.forwards
            self._proposed += sum(decoded.proposed)
            self._accepted += sum(decoded.accepted)
        for i, rid in enumerate(request_ids):
            row = self._rows.get(rid)
            if row is None or row.done:
                continue  # already finished: these are the pipeline's wasted extra tokens
            tokens: list[int] = []
            logprobs: list[Any] = []
            reason = None
            proposed, accepted = row.proposed, row.accepted
            for decoded in steps:
                token = decoded.token_ids[i]
                if decoded.proposed:
                    row.proposed += decoded.proposed[i]
                    row.accepted += decoded.accepted[i]
                if token is None:
                    continue  # the row emitted fewer tokens in this speculative step
                tokens.append(token)
                logprobs.append(decoded.logprobs[i])
                row.generated.append(token)
                self._tokens += 1
                if token in eos:
                    reason = FinishReason.STOP
                elif row.num_generated >= row.request.params.max_tokens:
                    reason = FinishReason.LENGTH
                if reason is not None:
                    break
            try:
                row.request.reply.send_nowait(TokensDecoded(
                    rid, tuple(tokens), tuple(logprobs) if logprobs[0] is not None else None,
                    proposed=row.proposed - proposed, accepted=row.accepted - accepted))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                row.done = ended = True
                self._cancelled += 1
                continue
            if reason is not None:
                self._finish(row, reason)
                ended = True
        return ended

    def _finish(self, row: RunningRow, reason: FinishReason) -> None:
        """The row's last event goes out now; it ends (`Lane.end_request`) when it leaves the batch."""
        row.done = True
        self._finished += 1
        try:
            row.request.reply.send_nowait(GenerationEnded(row.request.request_id, reason))
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            pass  # the session left: nobody waits for the last word

    def _fail_all(self, exc: BaseException) -> None:
        """End every row after the batch failed. Out of memory is no row's fault: the budget shrinks below what
        was held (actors/memory_budget.py) and the rows end without a last word, so each resumes (fewer fit now)."""
        resume = out_of_memory(exc)
        if isinstance(exc, trio.Cancelled):
            error: BaseException = ActorCrashed("the engine is stopping")
        elif resume:
            log.warning("decode step ran out of memory with %d rows and %.1f MiB of KV: %s; they resume under a "
                        "smaller KV budget", len(self._rows), self._kv_bytes / 2**20, exc)
            if self._lane.memory is not None:
                self._lane.memory.shrink(self._lane.held_kv_bytes())
            error = exc
        else:
            log.exception("decode step failed; failing %d rows", len(self._rows))
            error = exc if isinstance(exc, Exception) else ActorCrashed(repr(exc))
        for row in self._rows.values():
            self._lane.end_request(row.request, None if row.done or resume else _failed(row.request, error))
        self._rows.clear()
        for join in self._joining:
            self._lane.end_request(join.request, None if resume else _failed(join.request, error), row=join.row)
        self._joining = []
        self._kv_bytes = 0


def speculation_for(config: EngineConfig, model: LoadedModel | None) -> SpeculationConfig | None:
    """How a lane's batch speculates (--draft-model, else --prompt-lookup), or None."""
    if model is not None and model.draft is not None:
        return SpeculationConfig.draft(model.draft, config.num_draft_tokens, prefill_step_size=config.prefill_step_size,
                                       vocab_size=model.vocab_size)
    if not config.prompt_lookup:
        return None
    return SpeculationConfig.prompt_lookup(config.num_draft_tokens, config.prompt_lookup_ngram)


def _failed(request: Generate, error: BaseException) -> GenerationEnded:
    return GenerationEnded(request.request_id, FinishReason.ERROR, error)


def _membership(batch: DecodeBatch, leaving: list[str], puts: list[tuple[str, tuple[int, ...]]],
                joiners: list[tuple[Any, int]]) -> tuple[Decoded | None, list[Any]]:
    """A settle's lease job: flush, the leavers' prompt-cache entries, leave, join; (flushed tokens, entries).

    The flushed tokens are in the batch order from before the job. A module
    function over the batch, as `_steps_then` (scale-out runs it on every rank).
    """
    with span("membership.flush"):
        decoded = batch.flush_decoded()
    with span(f"membership.entries x{len(puts)}"):
        entries = [batch.cache_entry(rid, tokens) for rid, tokens in puts]
    if leaving:
        with span(f"membership.leave x{len(leaving)} of {len(batch.request_ids)}"):
            batch.leave(leaving)
    if joiners:
        with span(f"membership.join x{len(joiners)} to {len(batch.request_ids)}"):
            batch.join_many(joiners)
    return decoded, entries


def _steps_then(batch: DecodeBatch, steps: int, report: Callable[[list[Decoded]], None],
                keep_going: Callable[[], bool]) -> bool:
    """One link of the step chain, on the lease thread: the batch's steps, then whether to go on.

    A module function over the batch, not a method of the actor: under scale-out every rank runs
    each link (engine/distributed/), and only the batch has a copy on the other ranks; `report`
    and `keep_going` are rank 0's (they are no-ops elsewhere).
    """
    batch.steps_decoded(steps, report)
    return keep_going()
