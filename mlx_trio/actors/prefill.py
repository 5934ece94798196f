"""The prefill actor: joiners prefill alone, one chunk per lease job (docs/design.md §2).

Each chunk of a long prompt is one GPU-lease job, queued behind the decode
jobs already waiting, so running rows stall at most one chunk while it
prefills (chunks are a quarter as long while rows decode). Short prompts
that wait together prefill as a cohort: one batch of equal real-token
chunks (engine/batch/cohort_prefill.py) in one lease job bounded by one chunk of
tokens (each row weighted by its context while rows decode). The last prompt token is fed as an L=1 step that samples token 0
on the row's own caches (mlx-lm's convention); a row that is already
finished at token 0 never joins the batch. Prompt-cache hits start a
prefill part-way; boundary snapshots are stored on the way. A request
that ends here (an error, a left session, EOS or max_tokens at token 0)
ends through `Lane.end_request`.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from functools import partial

import attrs
import trio

from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.actors.lane import Lane
from mlx_trio.actors.messages import Generate, GenerationEnded, JoinRow, PrefillProgressed, TokensDecoded, drain_nowait
from mlx_trio.actors.prompt_caching import PromptCaching
from mlx_trio.engine.prompt_cache.ram_tier import CacheHit
from mlx_trio.engine.batch.cohort_prefill import prefill_rows
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.errors import LeaseClosed
from mlx_trio.events import FinishReason
from mlx_trio.supervision.faults import InjectedFault

log = logging.getLogger("mlx_trio.prefill")

# A prefill this long (uncached tokens) stores a boundary snapshot (docs/design.md §2.6).
SNAPSHOT_MIN_TOKENS = 256
# While rows decode, a joiner prefills chunks of prefill_step_size / this: a chunk's cost (and so
# the decode stall) grows with its length times the prefix (H200, 1B shape, 8.5k prompt: 666 ms
# per 2048-token chunk; docs/benchmarks.md).
DECODING_CHUNK_DIVISOR = 4


def cohort_weight(uncached: int, context: int, chunk: int) -> float:
    """A cohort row's share of the cohort budget (`chunk` tokens) while other rows decode.

    Its uncached tokens, scaled by how many chunks its attention spans: the
    forward's linear work grows with the tokens alone, its attention with
    tokens times context, and MLX's CUDA backend materialises those scores
    for a prefill (docs/benchmarks.md, third pass). So 16 fresh 128-token
    prompts fill a 2048-token cohort, while prompts that add 128 tokens to
    an 8k cached prefix fill it at 3: about as many query-by-context score
    entries as one 512-token chunk of an 8.5k prompt, a decode stall already
    accepted (`DECODING_CHUNK_DIVISOR`).
    """
    return uncached * max(1.0, context / chunk)


@attrs.frozen
class PrefillStatistics:
    mailbox_depth: int
    active_request: str | None
    active_kv_bytes: int
    prefilled: int
    cancelled: int
    failed: int
    prefill_tokens: int  # prompt tokens run through the model (cache hits excluded)
    cached_tokens: int  # prompt tokens served from the prompt cache
    snapshots: int
    cohort_rows: int  # requests prefilled in one lease job with others (engine/batch/cohort_prefill.py)


class PrefillActor:
    """Turns admitted requests into rows that hold token 0, and hands them to the decoder."""

    def __init__(self, lane: Lane, lease: GpuLease, join: trio.MemorySendChannel[JoinRow]) -> None:
        # `join`: the decode-step actor's inbox of prefilled rows.
        self._lane = lane
        self._lease = lease
        self._faults = lane.faults
        self._join = join
        self._prefill_step_size = prefill_step_size = lane.config.prefill_step_size
        self._decoding_chunk = max(prefill_step_size // DECODING_CHUNK_DIVISOR, 1)
        # At most --batch requests are admitted at once, so this never fills.
        self.inbox_send, self._inbox = trio.open_memory_channel[Generate](lane.config.batch)
        self._active: SoloRow | None = None
        self._active_request: Generate | None = None
        # Requests taken from the inbox ahead of their turn (FIFO), and the cohort
        # being prefilled together (see _prefill_cohort).
        self._backlog: collections.deque[Generate] = collections.deque()
        self._cohort_requests: list[Generate] = []
        self._prefilled = self._cancelled = self._failed_count = 0
        self._prefill_tokens = self._cached_tokens = self._snapshots = self._cohort_rows = 0

    def in_flight(self) -> list[Generate]:
        """The requests taken from the inbox and not handed on yet (those still in it are ours too)."""
        active = [self._active_request] if self._active_request is not None else []
        return [*active, *self._cohort_requests, *self._backlog]

    def statistics(self) -> PrefillStatistics:
        row = self._active
        return PrefillStatistics(
            mailbox_depth=self._inbox.statistics().current_buffer_used,
            active_request=row.request_id if row is not None else None,
            active_kv_bytes=row.nbytes if row is not None else 0,
            prefilled=self._prefilled, cancelled=self._cancelled, failed=self._failed_count,
            prefill_tokens=self._prefill_tokens, cached_tokens=self._cached_tokens, snapshots=self._snapshots,
            cohort_rows=self._cohort_rows,
        )

    async def run(self, *, task_status: trio.TaskStatus[PrefillActor] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        try:
            self._model = await self._lane.wait_model()
            while True:
                # Requests stay in the backlog (where a crash or restart ends them) until taken
                # below, with no checkpoint between taking and owning them.
                if not self._backlog:
                    self._backlog.append(await self._inbox.receive())
                self._backlog.extend(drain_nowait(self._inbox))
                hits, first_hit = await self._cohort()
                if hits:
                    await self._prefill_cohort([(self._backlog.popleft(), hit) for hit in hits])
                else:
                    await self._prefill(self._backlog.popleft(), first_hit)
        finally:
            self.inbox_send.close()
            for cmd in [*self._backlog, *drain_nowait(self._inbox)]:
                self._lane.end_request(cmd)  # no last word: its session resumes
            self._backlog.clear()

    def _snapshot_point(self, cmd: Generate, hit: CacheHit | None, caching: PromptCaching | None) -> int | None:
        """Where this prefill stores a snapshot (docs/design.md §2.6), or None.

        Only a prefill of at least `SNAPSHOT_MIN_TOKENS` uncached tokens pays
        for one. It goes at the prompt's last message boundary, so sibling
        agents (same system prompt) and the conversation's next turn hit it,
        even while this request still decodes. Caches that cannot be trimmed
        (sliding windows, recurrent state) get one at the end of the prompt
        instead when there is no new boundary to store (the finish-time entry,
        prompt + generated, cannot be cut back to serve a repeat of this
        prompt). One snapshot per prefill at most.
        """
        if caching is None:
            return None
        total = len(cmd.prompt_ids)
        cached = hit.usable if hit is not None else 0
        if total - 1 - cached < SNAPSHOT_MIN_TOKENS:
            return None
        layout = self._model.kv_layout
        candidates = [cmd.snapshot_at] if cmd.snapshot_at is not None else []
        if layout.window or layout.fixed_bytes:
            candidates.append(total - 1)
        for at in candidates:
            if cached < at < total and not caching.has(cmd.prompt_ids[:at]):
                return at
        return None

    async def _cohort(self) -> tuple[list[CacheHit | None], CacheHit | None]:
        """Prompt-cache hits of the backlog's first requests that are short enough to prefill in one job.

        Empty when the first itself is not short (it then prefills chunk by
        chunk). A request is short when its uncached prompt fits one chunk
        (the smaller one while rows decode) and it stores no snapshot. The
        cohort's tokens fit one chunk (`prefill_step_size`, the reference
        design's cohort budget); while rows decode, each row counts by
        `cohort_weight`, so rows attending over a long cached context make
        smaller cohorts and the running rows' stall stays about that of one
        decoding-size chunk of a long prompt. Takes nothing from the backlog;
        also returns the first request's hit (its one lookup, when it prefills alone).
        """
        decoding = self._lane.decoding
        caching = self._lane.caching
        hits: list[CacheHit | None] = []
        used = 0.0
        first_hit: CacheHit | None = None
        for i, cmd in enumerate(list(self._backlog)):
            hit = await caching.lookup(cmd.prompt_ids) if caching is not None else None
            first_hit = hit if i == 0 else first_hit
            uncached = len(cmd.prompt_ids) - 1 - (hit.usable if hit is not None else 0)
            if uncached > (self._decoding_chunk if decoding else self._prefill_step_size):
                break  # not short: it prefills alone, chunk by chunk
            weight = cohort_weight(uncached, len(cmd.prompt_ids), self._prefill_step_size) if decoding else uncached
            if used + weight > self._prefill_step_size or self._snapshot_point(cmd, hit, caching) is not None:
                break
            hits.append(hit)
            used += weight
        return hits, first_hit

    async def _prefill_cohort(self, cohort: list[tuple[Generate, CacheHit | None]]) -> None:
        """Prefill short requests in one lease job, as one batch where the model allows; then hand each on.

        B requests arriving together cost one job instead of 3B lease round
        trips, and (engine/batch/cohort_prefill.py) a few batched forwards instead of
        2B solo ones. A request alone is the solo prefill of `_prefill`.
        """
        self._cohort_requests = [cmd for cmd, _ in cohort]
        specs = [self._row_maker(cmd, hit) for cmd, hit in cohort]
        outcomes: list[SoloRow | Exception] = []
        try:
            self._faults.check("prefill")
            outcomes = await self._lease.run(prefill_rows, self._model.model, specs)
            self._cohort_rows += len(specs) if len(specs) > 1 else 0
            for (cmd, _), outcome in zip(cohort, outcomes, strict=True):
                self._cohort_requests.remove(cmd)
                if isinstance(outcome, Exception):
                    self._lane.end_request(cmd, self._failed(cmd, outcome))
                    continue
                self._prefill_tokens += outcome.fed - 1 - outcome.cached_tokens
                self._cached_tokens += outcome.cached_tokens
                total = len(cmd.prompt_ids)
                try:
                    cmd.reply.send_nowait(PrefillProgressed(cmd.request_id, outcome.cached_tokens, total,
                                                            cached_tokens=outcome.cached_tokens))
                    cmd.reply.send_nowait(PrefillProgressed(cmd.request_id, total - 1, total,
                                                            cached_tokens=outcome.cached_tokens))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the session left: _hand_on notices and frees the row
                await self._hand_on(cmd, outcome)
        finally:
            # Stopped or crashed part-way (a lease fault, a restart cancelling us): whatever was not
            # handed on is ended here, so its session resumes instead of waiting forever.
            pending = {cmd.request_id for cmd in self._cohort_requests}
            for (cmd, _), outcome in zip(cohort, outcomes or [None] * len(cohort)):
                if cmd.request_id in pending:
                    self._lane.end_request(cmd, row=outcome if isinstance(outcome, SoloRow) else None)
            self._cohort_requests = []

    def _row_maker(self, cmd: Generate, hit: CacheHit | None,
                   snapshot_at: int | None = None) -> Callable[[], SoloRow]:
        """Makes the request's `SoloRow` (on the lease thread: it builds caches)."""
        return partial(SoloRow, self._model.model, cmd.request_id, cmd.prompt_ids, cmd.params,
                       prefill_step_size=self._prefill_step_size, rng_draws=cmd.rng_draws, hit=hit,
                       snapshot_at=snapshot_at, grammar_tokenizer=self._model.grammar_tokenizer,
                       resumed_tokens=cmd.resumed_tokens)

    def _failed(self, cmd: Generate, exc: Exception) -> GenerationEnded:
        """A prefill error is this request's alone: count and log it; the event tells its session."""
        self._failed_count += 1
        log.error("prefill of %s failed", cmd.request_id, exc_info=exc)
        return GenerationEnded(cmd.request_id, FinishReason.ERROR, exc)

    async def _hand_on(self, cmd: Generate, row: SoloRow) -> None:
        """Send token 0, then end the request there or pass the row to the decoder; frees what does not join."""
        rid, joined = cmd.request_id, False
        caching = self._lane.caching
        ended: GenerationEnded | None = None
        try:
            token0 = row.token0
            assert token0 is not None
            logprobs = (row.token0_logprobs,) if row.token0_logprobs is not None else None
            cmd.reply.send_nowait(TokensDecoded(rid, (token0,), logprobs))
            self._prefilled += 1
            if token0 in self._model.eos_token_ids or cmd.params.max_tokens == 1:
                reason = FinishReason.STOP if token0 in self._model.eos_token_ids else FinishReason.LENGTH
                ended = GenerationEnded(rid, reason)
                if caching is not None:
                    # The row never joins: its prompt-only caches go back to the prompt cache.
                    caching.store(await self._lease.run(row.snapshot))
                return
            await self._join.send(JoinRow(cmd, row, token0))
            joined = True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._cancelled += 1
        finally:
            if not joined:
                self._lane.end_request(cmd, ended, row=row)

    async def _prefill(self, cmd: Generate, hit: CacheHit | None) -> None:
        """Prefill one request chunk by chunk (one lease job each, decode steps in between), then hand it on.

        `hit` is its prompt-cache lookup (made by `_cohort`).
        """
        self._active_request = cmd
        rid, total = cmd.request_id, len(cmd.prompt_ids)
        row: SoloRow | None = None
        ended: GenerationEnded | None = None
        caching = self._lane.caching
        try:
            row = await self._lease.run(self._row_maker(cmd, hit, self._snapshot_point(cmd, hit, caching)))
            self._active = row
            self._cached_tokens += row.cached_tokens
            cmd.reply.send_nowait(PrefillProgressed(rid, row.cached_tokens, total, cached_tokens=row.cached_tokens))
            while row.prefill_remaining:
                self._faults.check("prefill")
                before = row.fed
                # Rows decoding wait for each chunk: give them smaller ones.
                limit = self._decoding_chunk if self._lane.decoding else None
                remaining = await self._lease.run(row.prefill_chunk, limit)
                self._prefill_tokens += row.fed - before
                if caching is not None and row.fed == row.snapshot_at:
                    caching.store(await self._lease.run(row.snapshot))
                    self._snapshots += 1
                cmd.reply.send_nowait(PrefillProgressed(rid, total - 1 - remaining, total,
                                                        cached_tokens=row.cached_tokens))
            self._faults.check("prefill")
            await self._lease.run(row.first_token)
        except trio.BrokenResourceError:
            self._cancelled += 1  # the session left
        except (LeaseClosed, InjectedFault):
            # Not this request's fault: crash, and let the session resume on the restarted actor.
            raise
        except Exception as exc:
            ended = self._failed(cmd, exc)
        finally:
            self._active = None
            self._active_request = None
            if row is None or row.token0 is None:
                # The row never got to token 0: it ends here.
                self._lane.end_request(cmd, ended, row=row)
        if row is not None and row.token0 is not None:
            await self._hand_on(cmd, row)
