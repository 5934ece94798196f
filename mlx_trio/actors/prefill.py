"""The prefill actor: joiners prefill on their own caches, chunk by chunk in lease jobs (docs/design.md §2).

A prompt's chunks run in GPU-lease jobs queued behind the decode jobs
already waiting, so running rows stall at most one job. While rows decode
or other prompts wait, a chunk is sized from its measured cost to take about
`--prefill-chunk-ms` (actors/chunk_sizer.py), never more than
`--prefill-step-size` tokens, so it shrinks as the context grows, and one
job runs such chunks up to that target times the decode job's steps (a
prefill budget per cycle: `plan_chunks`, docs/design.md §2.2.3); a lone request with
nothing else running uses one full `--prefill-step-size` chunk a job,
exactly mlx-lm's (the goldens).

Up to `--prompt-concurrency` prompts prefill at once, their chunks
interleaved: the one with the fewest tokens left runs next, and one passed
over `AGING_CHUNKS` times in a row runs before it, so a short prompt never
waits for a long one and the long one still progresses. Each row joins the
batch as soon as its own prefill ends. Short prompts that wait together
prefill as a cohort: one right-padded batch
(engine/batch/cohort_prefill.py) in one lease job bounded like one chunk
(under prefill-only cuDNN, by the fitted cost of such jobs: `_shared_cohort_fits`).
The last prompt token is fed as an L=1 step that samples token 0 on the
row's own caches (mlx-lm's convention), in the last chunk's lease job
unless a snapshot is due in between; a row that is already finished at
token 0 never joins the batch. Prompt-cache hits start a prefill part-way;
boundary snapshots are stored on the way. A prompt whose session left stops
at the end of the job in flight: its KV is freed (its prefix, when long enough,
kept in the prompt cache) and the next prompt runs. A request that ends here
(an error, a left session, EOS or max_tokens at token 0) ends through
`Lane.end_request`. Under prefill-only cuDNN attention the actor first
builds cuDNN's plans of the shape grid's chunks, before its first request and
then while nothing runs (actors/plan_warmup.py).
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from functools import partial

import attrs
import trio

from mlx_trio.actors.chunk_sizer import ChunkSizer, CohortCost, timed
from mlx_trio.actors.decode_step import steps_per_job
from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.actors.memory_budget import out_of_memory
from mlx_trio.actors.lane import Lane
from mlx_trio.actors.messages import Generate, GenerationEnded, JoinRow, PrefillProgressed, TokensDecoded, drain_nowait
from mlx_trio.actors.plan_warmup import PlanWarmup, prefill_only_cudnn, sizer_shape
from mlx_trio.actors.prompt_caching import AdapterCaching, PromptCaching
from mlx_trio.actors.siblings import shared_with, sibling_point
from mlx_trio.engine.prompt_cache.ram_tier import CacheHit
from mlx_trio.engine.batch.chunked_prefill import GPU_GRID
from mlx_trio.engine.batch.cohort_prefill import (COHORT_CUDNN_MAX_CONTEXT, COHORT_CUDNN_MAX_TOKENS, prefill_rows,
                                                   prefill_rows_into, shares_forwards)
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv.blocks.paged_kv import PagedKV
from mlx_trio.engine.adapters.resident import ResidentAdapters
from mlx_trio.errors import AdapterError, LeaseClosed
from mlx_trio.profiling import request_phase
from mlx_trio.events import FinishReason
from mlx_trio.supervision.faults import InjectedFault

log = logging.getLogger("mlx_trio.prefill")

# A prefill this long (uncached tokens) stores a boundary snapshot (docs/design.md §2.6).
SNAPSHOT_MIN_TOKENS = 256
# Until a chunk was measured (the sizer knows no cost yet), a busy prefill uses chunks of
# prefill_step_size / this: a chunk's cost grows with its length times the prefix (H200, 1B
# shape, 8.5k prompt: 666 ms per 2048-token chunk; docs/lab-notes/).
DECODING_CHUNK_DIVISOR = 4
# A prefill passed over this many chunks in a row (shorter ones ran) runs the next one.
AGING_CHUNKS = 4
# A shared cohort's job takes at most this many forward groups' tokens (engine/batch/cohort_prefill.py).
COHORT_JOB_CHUNKS = 2
# While every waiting request needs an adapter slot held by running rows, how often to look again.
ADAPTER_SLOT_POLL_S = 0.005
# While cuDNN plans are left to build in idle time and rows decode, how often to look whether they ended.
IDLE_POLL_S = 0.05
# Idle-time cuDNN plans wait until nothing was prefilled or decoded for this long: a closed loop's next wave
# arrives the moment the last one ends, and a plan job (60-90 ms on an H200) started in that gap held the
# whole wave back (docs/lab-notes/2026-12-04-h200-pass18.md).
PLAN_QUIET_S = 0.5
# A cohort waits at most this long for a wave's requests still being prepared (`_gather`), and looks again this
# often: a wave of 63 on an H200 was prepared over ~80 ms (docs/lab-notes/2026-12-04-h200-pass19.md).
GATHER_MAX_S = 0.1
GATHER_POLL_S = 0.002


def cohort_weight(uncached: int, context: int, chunk: int) -> float:
    """A cohort row's share of the cohort budget (`chunk` tokens) while other rows decode.

    Its uncached tokens, scaled by how many chunks its attention spans: the
    forward's linear work grows with the tokens alone, its attention with
    tokens times context, and MLX's CUDA backend materialises those scores
    for a prefill (docs/lab-notes/2026-11-29-h200-pass03.md). So 16 fresh 128-token
    prompts fill a 2048-token cohort, while prompts that add 128 tokens to
    an 8k cached prefix fill it at 3: about as many query-by-context score
    entries as one 512-token chunk of an 8.5k prompt, a decode stall already
    accepted (`DECODING_CHUNK_DIVISOR`).
    """
    return uncached * max(1.0, context / chunk)


@attrs.frozen
class PrefillStatistics:
    mailbox_depth: int
    active_request: str | None  # the prefill whose chunk runs now (or ran last)
    active_kv_bytes: int  # KV bytes of every prompt prefilling now
    prefilled: int
    cancelled: int
    failed: int
    prefill_tokens: int  # prompt tokens run through the model (cache hits excluded)
    cached_tokens: int  # prompt tokens served from the prompt cache
    snapshots: int
    cohort_rows: int  # requests prefilled in one lease job with others (engine/batch/cohort_prefill.py)
    prefilling: int = 0  # prompts prefilling now, their chunks interleaved (at most --prompt-concurrency)
    chunks: int = 0  # solo prefill chunks run (one lease job each)
    sized_chunks: int = 0  # of those, sized to --prefill-chunk-ms (others decoded or waited)
    partial_puts: int = 0  # prefixes of left prompts kept in the prompt cache
    cudnn_plans: int = 0  # prefill chunk shapes planned ahead under prefill-only cuDNN (actors/plan_warmup.py)
    cudnn_plans_pending: bool = False  # idle time still has shapes to plan (each a lease job while nothing decodes)


@attrs.define(eq=False)
class _Job:
    """A prompt prefilling on its own row, chunk by chunk, between the chunks of others."""

    cmd: Generate
    row: SoloRow
    passed_over: int = 0  # chunks of other jobs run since this one last ran (aging)
    hit: CacheHit | None = None  # the prompt-cache entry the row started from


class PrefillActor:
    """Turns admitted requests into rows that hold token 0, and hands them to the decoder."""

    def __init__(self, lane: Lane, lease: GpuLease, join: trio.MemorySendChannel[JoinRow]) -> None:
        # `join`: the decode-step actor's inbox of prefilled rows.
        self._lane = lane
        self._lease = lease
        self._faults = lane.faults
        self._join = join
        config = lane.config
        self._prefill_step_size = prefill_step_size = config.prefill_step_size
        self._prefill_grid = config.prefill_grid
        self._default_chunk = max(prefill_step_size // DECODING_CHUNK_DIVISOR, 1)
        self._concurrency = config.prompt_concurrency
        # Kept across requests (not across restarts: a restart re-measures in a chunk or two).
        self.sizer = ChunkSizer(config.prefill_chunk_ms / 1000, prefill_step_size)
        # What a shared cohort job costs (`_shared_cohort_fits`): a fit of its own, from such jobs only.
        self.cohort_cost = CohortCost()
        # At most --batch requests are admitted at once, so this never fills.
        self.inbox_send, self._inbox = trio.open_memory_channel[Generate](lane.row_bound)
        # Requests taken from the inbox and not started (FIFO), the prompts prefilling
        # (at most --prompt-concurrency, in start order), and a cohort being prefilled together.
        self._backlog: collections.deque[Generate] = collections.deque()
        self._jobs: list[_Job] = []
        self._cohort_requests: list[Generate] = []
        self._last_request: str | None = None
        self._prefilled = self._cancelled = self._failed_count = 0
        self._prefill_tokens = self._cached_tokens = self._snapshots = self._cohort_rows = 0
        self._chunks = self._sized_chunks = self._partial_puts = 0
        self._plans = PlanWarmup.none(lease)  # cuDNN's prefill plans, built once the model is known
        self._active_at = 0.0  # trio time the actor last had a prompt or saw rows decoding (`_idle`)
        # (backlog request, prefilling request) pairs `_share_with_jobs` looked at; cleared when either side is empty.
        self._paired: set[tuple[str, str]] = set()

    def in_flight(self) -> list[Generate]:
        """The requests taken from the inbox and not handed on yet (those still in it are ours too)."""
        return [*(job.cmd for job in self._jobs), *self._cohort_requests, *self._backlog]

    def statistics(self) -> PrefillStatistics:
        return PrefillStatistics(
            mailbox_depth=self._inbox.statistics().current_buffer_used,
            active_request=self._last_request if self._jobs else None,
            active_kv_bytes=sum(job.row.nbytes for job in self._jobs),
            prefilled=self._prefilled, cancelled=self._cancelled, failed=self._failed_count,
            prefill_tokens=self._prefill_tokens, cached_tokens=self._cached_tokens, snapshots=self._snapshots,
            cohort_rows=self._cohort_rows, prefilling=len(self._jobs), chunks=self._chunks,
            sized_chunks=self._sized_chunks, partial_puts=self._partial_puts, cudnn_plans=self._plans.planned,
            cudnn_plans_pending=self._plans.pending,
        )

    async def run(self, *, task_status: trio.TaskStatus[PrefillActor] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        try:
            self._model = await self._lane.wait_model()
            await self._warm_plans()
            self._active_at = trio.current_time()
            while True:
                # Requests stay in the backlog or the jobs (where a crash or restart ends them)
                # until handed on, with no checkpoint between taking and owning them.
                if not self._backlog and not self._jobs:
                    if not await self._idle():
                        continue
                self._active_at = trio.current_time()
                self._backlog.extend(drain_nowait(self._inbox))
                await self._drop_left()
                await self._share_with_jobs()
                if len(self._jobs) < self._concurrency and self._startable():
                    if not self._jobs and self._wave_coming():
                        await self._gather()
                        if not self._startable():
                            continue
                    await self._start_next()
                elif self._jobs:
                    await self._run_chunk(next_job(self._jobs))
                else:
                    # Every waiting request needs an adapter slot that running rows hold: wait for one to leave.
                    await trio.sleep(ADAPTER_SLOT_POLL_S)
        finally:
            self.inbox_send.close()
            for job in self._jobs:
                self._lane.end_request(job.cmd, row=job.row)  # no last word: its session resumes
            self._jobs.clear()
            for cmd in [*self._backlog, *drain_nowait(self._inbox)]:
                self._lane.end_request(cmd)
            self._backlog.clear()

    async def _warm_plans(self) -> None:
        """The list of cuDNN's grid shapes that idle time plans (actors/plan_warmup.py); plans none itself."""
        config = self._lane.config
        self._plans = await PlanWarmup.open(self._lease, self._model.model, grid=config.prefill_grid,
                                            step_size=self._prefill_step_size, warm_tokens=config.cudnn_warm_tokens)

    async def _idle(self) -> bool:
        """With nothing to prefill: take the next request into the backlog and return True.

        While the warm-up has shapes left, a request already waiting is taken;
        with none, once nothing was prefilled or decoded for `PLAN_QUIET_S`, one
        shape is planned (one lease job) and False returned, so the loop looks
        again; before that, the next request is awaited until the quiet time is
        reached (with rows decoding, `IDLE_POLL_S` at most), then False.
        """
        if not self._plans.pending:
            self._backlog.append(await self._inbox.receive())
            return True
        try:
            self._backlog.append(self._inbox.receive_nowait())
            return True
        except trio.WouldBlock:
            pass
        if self._lane.decoding:
            self._active_at = trio.current_time()
        quiet = trio.current_time() - self._active_at
        if quiet < PLAN_QUIET_S:
            with trio.move_on_after(IDLE_POLL_S if self._lane.decoding else PLAN_QUIET_S - quiet):
                self._backlog.append(await self._inbox.receive())
                return True
            return False
        shape = await self._plans.warm_next()
        if shape is not None:
            self.sizer.know([sizer_shape(shape)])
        return False

    def _wave_coming(self) -> bool:
        """Whether more requests are on their way (being prepared: actors/arrivals.py) than rows decode, and the
        lane has room for them: a wave the next cohort should take whole (`_gather`)."""
        coming = self._lane.arrivals.expected()
        waiting = self._waiting
        return (coming > 0 and self._lane.decoding_rows < waiting + coming
                and self._lane.decoding_rows + waiting < self._lane.row_cap)

    async def _gather(self) -> None:
        """Take the wave's requests into the backlog as they come, until none is on its way or `GATHER_MAX_S`.

        A wave's prompts are prepared one after another (tens of ms for
        dozens); a cohort started on the first few leaves the rest to later
        jobs, each with its fixed costs, and every row of the wave waits for the
        last job before its batch decodes at full width. The decoding rows
        (fewer than the wave, `_wave_coming`) step on meanwhile.
        """
        deadline = trio.current_time() + GATHER_MAX_S
        with trio.move_on_at(deadline):
            while self._wave_coming():
                with trio.move_on_after(GATHER_POLL_S):
                    self._backlog.append(await self._inbox.receive())
                self._backlog.extend(drain_nowait(self._inbox))

    @property
    def _busy(self) -> bool:
        """Whether a chunk now makes others wait: rows decode, or another prompt prefills or waits.

        Only then are chunks sized to the target; a lone request uses full ones.
        """
        return self._lane.decoding or self._waiting > 1

    @property
    def _waiting(self) -> int:
        """Prompts not yet handed on: prefilling, in the backlog, or still in the inbox."""
        return len(self._jobs) + len(self._backlog) + self._inbox.statistics().current_buffer_used

    def _chunk_tokens(self, context: int) -> int:
        """A busy chunk's tokens after `context` cached ones: measured to fit the target, or the static default."""
        sized = self.sizer.tokens(context)
        return sized if sized is not None else self._default_chunk

    def _budget(self, row: SoloRow) -> tuple[int, ...]:
        """The chunk sizes of the row's next busy job (`plan_chunks`).

        While rows decode, the target is scaled by the decode job's steps
        (`steps_per_job`): with 2 or 4 steps a job at larger batches, one
        target per job left prefill a half or a quarter of the device share
        it has at small ones (`--batch 64` prefilled slower than `--batch 8`);
        each row still waits about one target per token it decodes.
        """
        if self.sizer.predict(1, 0) is None:
            return (self._default_chunk,)  # nothing measured yet
        target = budget_target_s(self.sizer.target_s, self._lane.decoding_rows)
        return plan_chunks(self._chunk_tokens, self.sizer.predict, target, row.fed, row.prefill_remaining,
                           row.snapshot_at if row.snapshot_at is not None and row.snapshot_at > row.fed else None)

    async def _drop_left(self) -> None:
        """End the prompts whose session left, before their next chunk: free their KV, let the next run.

        A started prompt's prefix (at least `SNAPSHOT_MIN_TOKENS` prefilled
        here) stays in the prompt cache for a retry; its row is freed.
        """
        for cmd in [cmd for cmd in self._backlog if _left(cmd)]:
            self._backlog.remove(cmd)
            self._cancelled += 1
            self._lane.end_request(cmd)
        for job in [job for job in self._jobs if _left(job.cmd)]:
            await self._drop(job)

    async def _drop(self, job: _Job) -> None:
        """End a started prompt whose session left; keep its prefix in the prompt cache when long enough."""
        self._jobs.remove(job)
        try:
            await self._keep_prefix(job.cmd, job.row)
        finally:
            self._lane.end_request(job.cmd, row=job.row)
            # Counted once it is ended (reservation released, row freed), so a reader of the count
            # never sees a cancelled prompt that still holds its reservation.
            self._cancelled += 1

    async def _keep_prefix(self, cmd: Generate, row: SoloRow) -> None:
        caching = self._caching(cmd)
        if caching is None or row.fed - row.cached_tokens < SNAPSHOT_MIN_TOKENS or caching.has(cmd.prompt_ids[:row.fed]):
            return
        caching.store(await self._lease.run(row.snapshot))  # a lazy clone: shares the row's buffers
        self._partial_puts += 1

    async def _share_with_jobs(self) -> None:
        """A request that shares a long prefix with a prompt already prefilling gets it from that prefill.

        Siblings that arrive together wait for the snapshot the first one
        stores where their prompts part (`_snapshot_point`); one that arrives
        while it prefills asks the same of the running prefill: a snapshot where
        the two part, if the prefill has not passed that point yet, else (caches
        that a hit may trim) a snapshot of what it holds now. The request then
        waits for it (`_startable`) and starts from the prompt cache. Each pair is
        looked at once.
        """
        if not self._jobs or not self._backlog:
            self._paired.clear()
            return
        for cmd in self._backlog:
            for job in self._jobs:
                pair = (cmd.request_id, job.cmd.request_id)
                if pair in self._paired:
                    continue
                self._paired.add(pair)
                shared = shared_with(cmd, job.cmd)
                caching = self._caching(cmd)
                if (shared - job.row.cached_tokens < SNAPSHOT_MIN_TOKENS or caching is None
                        or any(_awaits_snapshot(cmd, other) for other in self._jobs)):
                    continue
                if job.row.fed < shared:
                    await self._lease.run(job.row.snapshot_later, shared)
                elif self._trimmable and not caching.has(job.cmd.prompt_ids[:job.row.fed]):
                    caching.store(await self._lease.run(job.row.snapshot))
                    self._snapshots += 1

    @functools.cached_property
    def _trimmable(self) -> bool:
        """Whether a prompt-cache entry of this model serves a shorter prefix of itself (no window, no fixed state)."""
        layout = self._model.kv_layout
        return not (layout.window or layout.fixed_bytes)

    def _caching(self, cmd: Generate) -> PromptCaching | AdapterCaching | None:
        """The prompt cache as this request uses it (a request with an adapter: that adapter's namespace)."""
        return self._lane.caching_for(cmd)

    def _startable(self) -> bool:
        """Whether a backlog request may start; the first that may is moved to the head.

        A request whose prompt extends a snapshot a running job is about to
        store waits for it (its chunks run meanwhile), then starts from the
        cache: N agents sharing a system prompt prefill it once.

        A request whose adapter needs a slot that running rows all hold waits
        until one leaves (`--max-loras`), while others go ahead.
        """
        for i, cmd in enumerate(self._backlog):
            if self._adapters_fit([cmd]) and not any(_awaits_snapshot(cmd, job) for job in self._jobs):
                if i:
                    del self._backlog[i]
                    self._backlog.appendleft(cmd)
                return True
        return False

    def _adapters_fit(self, cmds: list[Generate]) -> bool:
        """Whether every adapter these requests name can hold a slot at once now."""
        names = [cmd.adapter for cmd in cmds if cmd.adapter is not None]
        return not names or self._lane.adapters is None or self._lane.adapters.can_hold(names)

    async def _start_next(self) -> None:
        """Start the backlog's head: as a cohort with the short ones behind it, or as a job of its own."""
        hits, first_hit = await self._cohort()
        if hits:
            await self._prefill_cohort([(self._backlog.popleft(), hit) for hit in hits])
        else:
            await self._start_job(self._backlog.popleft(), first_hit)

    def _snapshot_point(self, cmd: Generate, hit: CacheHit | None, caching: PromptCaching | None) -> int | None:
        """Where this prefill stores a snapshot (docs/design.md §2.6), or None.

        Only a prefill of at least `SNAPSHOT_MIN_TOKENS` uncached tokens pays
        for one. It goes where the prompt parts from a request waiting beside
        it (its longest shared prefix, actors/siblings.py: the sibling waits for
        the snapshot instead of prefilling the same tokens), else at the prompt's
        last message boundary, so sibling agents (same system prompt) and the
        conversation's next turn hit it, even while this request still decodes.
        Caches that cannot be trimmed
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
        # First where the prompt parts from a sibling waiting beside it (actors/siblings.py): they wait for it.
        sibling = sibling_point(cmd, self._backlog, start=cached, minimum=SNAPSHOT_MIN_TOKENS)
        candidates = [at for at in (sibling, cmd.snapshot_at) if at is not None]
        if layout.window or layout.fixed_bytes:
            candidates.append(total - 1)
        elif candidates and prefill_only_cudnn() and self._grid_step > 0:
            # The prefill moves the boundary to the grid point below (engine/batch/chunked_prefill.py), where
            # the snapshot then lands: a sibling agent that hit it there needs no other, or each would ask again.
            candidates = [at // self._grid_step * self._grid_step for at in candidates]
        for at in candidates:
            if cached < at < total and not caching.has(cmd.prompt_ids[:at]):
                return at
        return None

    async def _cohort(self) -> tuple[list[CacheHit | None], CacheHit | None]:
        """Prompt-cache hits of the backlog's first requests that are short enough to prefill in one job.

        Empty when the first itself is not short (it then prefills chunk by
        chunk). A request is short when its uncached prompt fits one chunk
        (while busy, the sized chunk at its context) and it stores no
        snapshot. The cohort's tokens fit one chunk (`prefill_step_size`, the
        reference design's cohort budget, or while busy the sized chunk of a
        fresh prompt once measured); while busy, each row counts by
        `cohort_weight`, so rows attending over a long cached context make
        smaller cohorts and the running rows' stall stays about that of one
        sized chunk of a long prompt. Where the rows prefill one after another
        (`_timed_cohort`), each row counts by its predicted prefill time instead
        and the cohort fills `--prefill-chunk-ms`; a cohort that shares its forwards
        there (`_shares_forwards`) counts its padded tokens, rows x the longest
        uncached prompt (`_shared_cohort_fits`). While more rows wait than decode, each
        of those budgets is that many times larger (`_wave_scale`). Takes nothing from the backlog;
        also returns the first request's hit (its one lookup, when it prefills alone).
        With --kv-layout paged a cohort takes only requests whose prompts start with no cached block
        (`_starts_uncached`), at most `COHORT_JOB_CHUNKS` steps of padded tokens (rows x the longest prompt: its own
        caches, outside the pool, `_prefill_cohort`), and at least two (one alone prefills into the pool directly).
        """
        paged = self._model.paged_kv
        busy = self._busy
        scale = self._wave_scale()
        chunk = (self.sizer.tokens(0) or self._prefill_step_size) if busy else self._prefill_step_size
        budget = chunk * scale if busy else chunk
        hits: list[CacheHit | None] = []
        used = 0.0
        longest = 0  # a shared cohort's longest uncached prompt: its forwards' padded length
        first_hit: CacheHit | None = None
        shared = False  # the cohort shares its forwards under prefill-only cuDNN (`_shares_forwards`)
        taken: list[Generate] = []  # the cohort's requests so far (--kv-layout paged: `_starts_uncached`)
        for i, cmd in enumerate(list(self._backlog)):
            caching = self._caching(cmd)
            limit = self._model.kv_scheme.hit_limit(len(cmd.prompt_ids), self._prefill_step_size)
            hit = await caching.lookup(cmd.prompt_ids, limit=limit) if caching is not None else None
            first_hit = hit if i == 0 else first_hit
            cached = hit.usable if hit is not None else 0
            uncached = len(cmd.prompt_ids) - 1 - cached
            if i == 0:
                shared = self._shares_forwards(cmd)
            elif shared != self._shares_forwards(cmd):
                break  # a cohort either shares its forwards or prefills row after row
            if busy and self._timed_cohort and not shared:
                # Its whole prefill and token 0 as the sizer predicts them; a first row over the
                # target alone is not short (it prefills chunk by chunk).
                weight = self._alone_seconds(uncached, cached)
                fits = used + weight <= self.sizer.target_s * scale
            else:
                if uncached > (self._chunk_tokens(cached) if busy else self._prefill_step_size):
                    break  # not short: it prefills alone, chunk by chunk
                if shared:
                    # Right-padded to the longest: the forwards cost rows x that length.
                    weight = (len(hits) + 1) * max(longest, uncached) - used
                    fits = self._shared_cohort_fits(len(hits) + 1, used + weight, scale)
                else:
                    weight = cohort_weight(uncached, len(cmd.prompt_ids), chunk) if busy else uncached
                    fits = used + weight <= budget
            if not fits or self._snapshot_point(cmd, hit, caching) is not None:
                break
            # --kv-layout paged: the cohort's own caches are outside the pool, which holds the whole KV budget,
            # until its job copies them into blocks (`_prefill_cohort`): a transient of one lease job, out of the
            # headroom the budget leaves (as a chunk's scores and activations are). Bounded here at two steps of
            # padded tokens (4096 by default; mlx-lm's caches round each row up to 256 positions, so a wave of 64
            # short prompts holds 16384: 512 MiB at Llama-1B's 32 KiB a token, 2 GiB at 8B's 128 KiB).
            if paged is not None and (not self._starts_uncached(cmd, taken)
                                      or (len(hits) + 1) * max(longest, uncached)
                                      > COHORT_JOB_CHUNKS * self._prefill_step_size):
                break
            if not self._adapters_fit(list(self._backlog)[: i + 1]):
                break  # its adapter would need a slot the rows before it take
            hits.append(hit)
            taken.append(cmd)
            used += weight
            longest = max(longest, uncached)
        if paged is not None and len(hits) < 2:
            return [], first_hit
        return hits, first_hit

    def _starts_uncached(self, cmd: Generate, taken: list[Generate]) -> bool:
        """--kv-layout paged: whether `cmd` may join the cohort `taken`, prefilling on its own caches then copied
        into fresh blocks.

        Not with a pin (`Lane.pins`): admission credited its pinned prefix blocks and reserved only the rest, so
        its row must reference them (the solo paged path), or it would allocate more than it reserved. The pin
        alone decides soundness: an unpinned request reserved blocks for its whole prompt. Nor when the pool
        holds its first block now under the row's revision (a sibling cached it since admission; an adapter's
        blocks serve only its own revision's rows, `starts_cached`): a solo row computes only its tail. Nor
        when its first block is that of a request already taken (siblings of one system prompt in one wave):
        each would compute the prefix and hold a copy; after the first, the others take its blocks (the solo
        path's catch-up, or a later cohort's lookup) and compute their tails.
        """
        paged = self._model.paged_kv
        assert paged is not None
        n = paged.block_size
        if len(cmd.prompt_ids) - 1 >= n and any(other.adapter == cmd.adapter and
                                                  other.prompt_ids[:n] == cmd.prompt_ids[:n] for other in taken):
            return False
        return cmd.request_id not in self._lane.pins and not starts_cached(paged, self._lane, cmd)

    def _shares_forwards(self, cmd: Generate) -> bool:
        """Under prefill-only cuDNN, whether `cmd`'s row shares a cohort's forwards (engine/batch/cohort_prefill.py).

        Such a cohort is bounded by its padded tokens like any batched cohort,
        not by its rows' prefills one after another (`_timed_cohort`).
        """
        return self._model_shares_forwards and len(cmd.prompt_ids) <= COHORT_CUDNN_MAX_CONTEXT

    @functools.cached_property
    def _model_shares_forwards(self) -> bool:
        """`_shares_forwards`'s part that holds for the actor's model and backend: asked once, not once a request."""
        layout = self._model.kv_layout
        return (prefill_only_cudnn() and not (layout.window or layout.fixed_bytes)
                and not self._model.kv_scheme.quantized and shares_forwards(self._model.model))

    def _wave_scale(self) -> float:
        """How many times `--prefill-chunk-ms` (or its tokens) a cohort job may take now: waiting rows per decoding row.

        The target bounds the decode stall of running rows; it costs every
        waiting row its first token. When a wave arrives at once (a closed
        loop's next turns: 63 prompts behind one decoding row), cutting it into
        target-sized jobs kept all but a few waiting 0.2-0.3 s, behind jobs
        whose fixed costs repeat and step links between them (H200, 1B shape,
        c=64: 3-4 cohort jobs a wave; docs/lab-notes/2026-12-04-h200-pass18.md),
        to spare a row or two a longer gap. So the budget grows with the rows
        that wait against those that decode (1 while they are fewer); the job's
        forwards stay bounded (`_shared_cohort_fits`).
        """
        return max(1.0, self._waiting / max(self._lane.decoding_rows, 1))

    def _shared_cohort_fits(self, rows: int, padded: int, scale: float = 1.0) -> bool:
        """Whether `rows` requests sharing their forwards under prefill-only cuDNN may go in one job of `padded`
        tokens (rows x the longest uncached prompt).

        At most `COHORT_JOB_CHUNKS` forwards' worth of tokens (engine/batch/
        cohort_prefill.py `forward_groups`) always; and once shared cohort
        jobs of two padded sizes were measured (`CohortCost`), a predicted
        job time within `--prefill-chunk-ms`. Never the chunk sizer's
        prediction: fitted on lone prompts, it counts a job's fixed cost as a
        cost per token and overstates a padded batch several times (H200, ~46-
        token prompts at c=64: 2.3 rows a job instead of 16). One row is not a
        shared job (it prefills alone, bounded as a chunk by `_cohort`), so it
        always fits.
        """
        if padded > COHORT_JOB_CHUNKS * COHORT_CUDNN_MAX_TOKENS:
            return False
        predicted = self.cohort_cost.predict(padded)
        return rows == 1 or predicted is None or predicted <= self.sizer.target_s * scale

    @property
    def _timed_cohort(self) -> bool:
        """Whether a cohort's rows prefill one after another in its job, so a cohort is bounded by time.

        Under prefill-only cuDNN a batched forward would be a new cuDNN shape
        per cohort (engine/batch/cohort_prefill.py `can_prefill_together`), so
        each row runs the grid's planned chunks alone. The tokens rule
        (`cohort_weight`) bounds a batched forward's cost; rows in sequence cost
        the sum of their own prefills, which the sizer predicts once it has
        measured a chunk: the cohort then takes rows until their predicted
        time reaches `--prefill-chunk-ms`. Agents extending a long shared
        system prompt by a few hundred tokens each (a chunk of ~10 ms and
        token 0's step, H200, 1B shape) then prefill several to a lease job
        instead of taking four jobs each, each followed by a step link of a
        batch that stays small meanwhile (docs/lab-notes/2026-12-01-h200-pass12.md).
        Short prompts' cohorts share their forwards there (`_shares_forwards`) and
        are bounded by their padded tokens instead.
        """
        return prefill_only_cudnn() and self.sizer.predict(1, 0) is not None

    @property
    def _grid_step(self) -> int:
        """The prefill shape grid's step where prefill-only cuDNN runs (on a GPU: `--prefill-grid`, else 256)."""
        return self._prefill_grid if self._prefill_grid is not None else GPU_GRID

    def _alone_seconds(self, uncached: int, cached: int) -> float:
        """A row's predicted prefill alone (and token 0), as `SoloRow` runs it under prefill-only cuDNN.

        A start off the grid steps back to the grid point below (engine/batch/chunked_prefill.py).
        """
        grid = self._grid_step
        back = cached % grid if grid > 0 else 0
        seconds = self.sizer.predict_prefill(uncached + back, cached - back, self._prefill_step_size)
        return seconds if seconds is not None else float("inf")

    async def _prefill_cohort(self, cohort: list[tuple[Generate, CacheHit | None]]) -> None:
        """Prefill short requests in one lease job, as one batch where the model allows; then hand each on.

        B requests arriving together cost one job instead of 3B lease round
        trips, and (engine/batch/cohort_prefill.py) a few batched forwards instead of
        2B solo ones. A request alone is the solo prefill of `_prefill`.
        """
        self._cohort_requests = [cmd for cmd, _ in cohort]
        for cmd in self._cohort_requests:
            request_phase(cmd.request_id, "prefill")
        specs = [self._row_maker(cmd, hit, paged=False) for cmd, hit in cohort]  # a cohort's own cache
        # --kv-layout paged: its rows are copied into blocks in the same job (a transient of it, `_cohort`'s bound).
        paged = self._model.paged_kv
        job = (prefill_rows, self._model.model) if paged is None else (prefill_rows_into, paged, self._model.model)
        outcomes: list[SoloRow | Exception] = []
        try:
            self._faults.check("prefill")
            outcomes, seconds = await self._lease.run(timed, *job, specs)
            self._cohort_rows += len(specs) if len(specs) > 1 else 0
            made = [row for row in outcomes if isinstance(row, SoloRow)]
            if len(made) == 1:
                # A lone short prompt: a chunk and token 0's step, as a chunk's cost. A batched
                # cohort is not a measure of one prompt's chunk.
                self.sizer.record(made[0].fed - made[0].cached_tokens, made[0].cached_tokens, seconds,
                                  made[0].last_chunk_shape)
            elif len(made) > 1 and self._shares_forwards(cohort[0][0]):
                # The padded tokens the job's forwards fed: its rows x the longest they had left
                # (from where each row really started: a hit off the grid steps back).
                self.cohort_cost.record(len(made) * max(row.num_prompt_tokens - 1 - row.cached_tokens
                                                        for row in made), seconds)
            for (cmd, hit), outcome in zip(cohort, outcomes, strict=True):
                self._cohort_requests.remove(cmd)
                if isinstance(outcome, Exception):
                    self._lane.end_request(cmd, self._failed(cmd, outcome, hit))
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
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            # No request's fault: each ends below without a last word and resumes under the smaller budget.
            self._ran_out_of_memory(f"a cohort of {len(cohort)}", exc)
        finally:
            # Stopped or crashed part-way (a lease fault, a restart cancelling us): whatever was not
            # handed on is ended here, so its session resumes instead of waiting forever.
            pending = {cmd.request_id for cmd in self._cohort_requests}
            for (cmd, _), outcome in zip(cohort, outcomes or [None] * len(cohort)):
                if cmd.request_id in pending:
                    self._lane.end_request(cmd, row=outcome if isinstance(outcome, SoloRow) else None)
            self._cohort_requests = []

    def _row_maker(self, cmd: Generate, hit: CacheHit | None,
                   snapshot_at: int | None = None, *, paged: bool = True) -> Callable[[], SoloRow]:
        """Makes the request's `SoloRow` (on the lease thread: it builds caches and takes the adapter's slot).

        With --kv-layout paged (and `paged`) the row prefills into the model's block pool, from the cached blocks of
        its prompt's prefix (docs/design.md §6.5)."""
        pool = self._model.paged_kv if paged and hit is None and snapshot_at is None else None
        # The prefix admission pinned and credited (`Lane.pins`): the row takes its references over.
        pin = self._lane.pins.get(cmd.request_id) if pool is not None else None
        make = partial(SoloRow, self._model.model, cmd.request_id, cmd.prompt_ids, cmd.params, paged=pool, pin=pin,
                       prefill_step_size=self._prefill_step_size, rng_draws=cmd.rng_draws, hit=hit,
                       snapshot_at=snapshot_at, grammar_tokenizer=self._model.grammar_tokenizer,
                       resumed_tokens=cmd.resumed_tokens, prefill_grid=self._prefill_grid,
                       kv_scheme=self._model.kv_scheme)
        return make if cmd.adapter is None else partial(_with_adapter, self._lane.adapters, cmd.adapter, make)

    def _failed(self, cmd: Generate, exc: Exception, hit: CacheHit | None) -> GenerationEnded | None:
        """A prefill error is this request's alone: count and log it; the event tells its session.

        A row started from a prompt-cache entry drops that entry: if the entry
        is what fails (it cannot be restored), the resumed request and the
        next ones sharing its prefix run uncached instead of failing on it.
        Out of memory is not the request's fault: the KV budget shrinks below
        what was held (actors/memory_budget.py) and None is returned, so the
        request ends without a last word and resumes under the smaller budget.
        """
        if out_of_memory(exc):
            self._ran_out_of_memory(cmd.request_id, exc)
            return None
        self._failed_count += 1
        log.error("prefill of %s failed", cmd.request_id, exc_info=exc)
        if hit is not None and self._lane.caching is not None:
            self._lane.caching.discard(hit, exc)
        return GenerationEnded(cmd.request_id, FinishReason.ERROR, exc, own=True)

    def _ran_out_of_memory(self, what: str, exc: Exception) -> None:
        """The device's memory ran out prefilling `what`: shrink the KV budget below what the lane holds."""
        log.warning("prefill of %s ran out of memory: %s; it resumes under a smaller KV budget", what, exc)
        if self._lane.memory is not None:
            self._lane.memory.shrink(self._lane.held_kv_bytes())

    async def _hand_on(self, cmd: Generate, row: SoloRow) -> None:
        """Send token 0, then end the request there or pass the row to the decoder; frees what does not join."""
        rid, joined = cmd.request_id, False
        caching = self._caching(cmd)
        ended: GenerationEnded | None = None
        try:
            token0 = row.token0
            assert token0 is not None
            logprobs = (row.token0_logprobs,) if row.token0_logprobs is not None else None
            cmd.reply.send_nowait(TokensDecoded(rid, (token0,), logprobs))
            request_phase(rid, "token0")
            self._prefilled += 1
            if token0 in self._model.eos_token_ids or cmd.params.max_tokens == 1:
                reason = FinishReason.STOP if token0 in self._model.eos_token_ids else FinishReason.LENGTH
                ended = GenerationEnded(rid, reason)
                if caching is not None:
                    # The row never joins: its prompt-only caches go back to the prompt cache.
                    caching.store(await self._lease.run(row.snapshot))
                return
            if caching is not None:
                # Visible to lookups before any final event: the next turn waits for this row's put.
                caching.expect_put(rid, cmd.prompt_ids)
            join = JoinRow(cmd, row, token0)
            try:
                # No checkpoint while the channel has room: a cohort's rows are all waiting when the decoder
                # wakes, so they join in one settle, not the first alone and the rest after the next job.
                self._join.send_nowait(join)
            except trio.WouldBlock:
                await self._join.send(join)
            joined = True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._cancelled += 1
        finally:
            if not joined:
                self._lane.end_request(cmd, ended, row=row)

    async def _start_job(self, cmd: Generate, hit: CacheHit | None) -> None:
        """Make the request's row (from its prompt-cache hit, made by `_cohort`); its chunks then interleave."""
        caching = self._caching(cmd)
        row: SoloRow | None = None
        request_phase(cmd.request_id, "prefill")
        try:
            row = await self._lease.run(self._row_maker(cmd, hit, self._snapshot_point(cmd, hit, caching)))
            self._cached_tokens += row.cached_tokens
            cmd.reply.send_nowait(PrefillProgressed(cmd.request_id, row.cached_tokens, len(cmd.prompt_ids),
                                                    cached_tokens=row.cached_tokens))
            self._jobs.append(_Job(cmd, row, hit=hit))
            self._last_request = cmd.request_id
        except trio.BrokenResourceError:
            self._cancelled += 1  # the session left
            self._lane.end_request(cmd, row=row)
        except (LeaseClosed, InjectedFault):
            self._lane.end_request(cmd, row=row)  # no last word: its session resumes on the restarted actor
            raise
        except Exception as exc:
            self._lane.end_request(cmd, self._failed(cmd, exc, hit), row=row)
        except BaseException:
            self._lane.end_request(cmd, row=row)
            raise

    async def _run_chunk(self, job: _Job) -> None:
        """One lease job of `job`'s chunks (decode steps and other prompts' chunks in between).

        When busy (`_busy`) the job is a budget of chunks each sized to
        `--prefill-chunk-ms` at the row's context (`_budget`); otherwise it is
        one full `prefill_step_size` chunk, as mlx-lm's. Each chunk's time is
        measured for the next ones. After the prompt's
        last chunk, token 0's step runs and the row is handed on.
        """
        cmd, row = job.cmd, job.row
        rid, total = cmd.request_id, len(cmd.prompt_ids)
        caching = self._caching(cmd)
        ended: GenerationEnded | None = None
        self._last_request = rid
        try:
            if row.prefill_remaining:
                self._faults.check("prefill")
                busy = self._busy
                limits = self._budget(row) if busy else (None,)
                chunks = await self._lease.run(prefill_chunks_then_token0, row, limits)
                for before, cached, fed, now_cached, shape, seconds in chunks:
                    # --kv-layout paged: blocks a sibling cached meanwhile, taken before the chunk, were not computed.
                    skipped = now_cached - cached
                    self.sizer.record((shape[0] if shape is not None else fed - before) - skipped, before + skipped,
                                      seconds, shape)
                    self._prefill_tokens += fed - before - skipped
                    self._cached_tokens += skipped
                self._chunks += len(chunks)
                self._sized_chunks += busy * len(chunks)
                remaining = row.prefill_remaining
                fed = total - 1 - remaining  # the prompt tokens in the caches after the job (token 0's not counted)
                if caching is not None and fed == row.snapshot_at:
                    caching.store(await self._lease.run(row.snapshot))
                    self._snapshots += 1
                cmd.reply.send_nowait(PrefillProgressed(rid, total - 1 - remaining, total,
                                                        cached_tokens=row.cached_tokens))
                if remaining:
                    return
            if row.token0 is None:  # not in the last chunk's job: a snapshot was due in between
                self._faults.check("prefill")
                await self._lease.run(row.first_token)
        except trio.BrokenResourceError:
            await self._drop(job)  # the session left
            return
        except (LeaseClosed, InjectedFault):
            # Not this request's fault: crash, and let the session resume on the restarted actor
            # (`run`'s finally ends the job).
            raise
        except Exception as exc:
            ended = self._failed(cmd, exc, job.hit)
        if row.token0 is None:
            # The row failed before token 0: it ends here.
            self._jobs.remove(job)
            self._lane.end_request(cmd, ended, row=row)
            return
        self._jobs.remove(job)
        await self._hand_on(cmd, row)


def prefill_chunks_then_token0(row: SoloRow, limits: tuple[int | None, ...]
                               ) -> list[tuple[int, int, int, int, tuple[int, ...] | None, float]]:
    """A busy cycle's prefill budget (`plan_chunks`): the chunks of `limits` in one lease job, each evaluated and
    timed alone (the sizer's samples), ending early where the prompt ends or a snapshot is due; token 0 as in
    `prefill_chunk_then_token0`.

    Returns each chunk's (fed before, cached before, fed after, cached after, computed shape, seconds). Only
    the row and the limits decide what runs, so under scale-out every rank runs the same chunks.
    """
    chunks = []
    for limit in limits:
        before, cached = row.fed, row.cached_tokens
        remaining, seconds = prefill_chunk_then_token0(row, limit)
        fed = row.num_prompt_tokens - 1 - remaining  # token 0's input, fed at the end, not counted
        chunks.append((before, cached, fed, row.cached_tokens, row.last_chunk_shape, seconds))
        if not remaining or row.fed == row.snapshot_at:
            break
    return chunks


def budget_target_s(target_s: float, decoding_rows: int) -> float:
    """A busy prefill job's time budget: `target_s` (--prefill-chunk-ms) per decode step of the job it alternates
    with (`steps_per_job` of the rows decoding), so prefill's share of the device does not fall as --batch grows."""
    return target_s * (steps_per_job(decoding_rows) if decoding_rows else 1)


def plan_chunks(size: Callable[[int], int], predict: Callable[[int, int], float | None], target_s: float,
                context: int, remaining: int, stop_at: int | None = None) -> tuple[int, ...]:
    """The chunk sizes of one busy prefill job: a prefill budget of about `target_s` per cycle.

    Chunks of `size(context)` tokens (the sizer's, at most --prefill-step-size, so one chunk's transient
    memory is what admission counts) after `context` fed tokens, while the predicted seconds of the ones
    so far and the next stay within `target_s`; the first always runs. It ends with the `remaining`
    prompt tokens, or at `stop_at` (a snapshot is due there). When a chunk fits the target at a full
    step (short contexts on a fast device), one chunk per job left prefill about half of a busy device,
    alternating with the decode jobs; several per job give it the target's share.
    """
    chunks: list[int] = []
    used = 0.0
    while remaining > 0:
        n = min(size(context), remaining)
        if stop_at is not None and context < stop_at:
            n = min(n, stop_at - context)
        cost = predict(n, context)
        if chunks and (cost is None or used + cost > target_s):
            break
        chunks.append(n)
        used += cost or 0.0
        context, remaining = context + n, remaining - n
        if context == stop_at:
            break
    return tuple(chunks)


def prefill_chunk_then_token0(row: SoloRow, limit: int | None) -> tuple[int, float]:
    """One prefill chunk, timed alone (the sizer's sample); if it ended the prompt, token 0's step in the same job.

    Returns (prompt tokens left, the chunk's seconds). Token 0 waits when a
    snapshot is due where the chunk ended (it is taken of the prompt-only
    caches, before the step writes the last token). In the chunk's job, token
    0 is not a job of its own behind the next step link: one lease round trip
    and one step of the batch sooner (lease thread).
    """
    remaining, seconds = timed(row.prefill_chunk, limit)
    if not remaining and row.snapshot_at != row.fed:
        row.first_token()
    return remaining, seconds


def starts_cached(paged: PagedKV, lane: Lane, cmd: Generate) -> bool:
    """Whether the pool holds `cmd`'s first full block now under the revision its row would join with
    (`PagedKV.starts_cached`, `Lane.kv_revision`: both off the lease thread). An adapter no longer served: False
    (its row fails when it takes the adapter)."""
    revision = lane.kv_revision(cmd.adapter)
    return revision is not None and paged.starts_cached(cmd.prompt_ids, revision)


def _with_adapter(adapters: ResidentAdapters | None, name: str, make: Callable[..., SoloRow]) -> SoloRow:
    """`make(adapter=...)` holding `name`'s slot (written into one first if needed); lease thread only."""
    if adapters is None:
        raise AdapterError(f"adapter {name!r} is not loaded: this server serves no adapters")
    use = adapters.acquire(name)
    try:
        return make(adapter=use)
    except BaseException:
        use.release()
        raise


def next_job(jobs: list[_Job]) -> _Job:
    """The job whose chunk runs next: one passed over `AGING_CHUNKS` times, else the fewest tokens left.

    Shortest remaining first, so a short prompt behind a long one gets its
    token 0 within a chunk or two; aging, so a stream of short prompts never
    starves the long one (it runs at least one chunk in `AGING_CHUNKS + 1`).
    Updates every job's aging count.
    """
    aged = [job for job in jobs if job.passed_over >= AGING_CHUNKS]
    chosen = aged[0] if aged else min(jobs, key=lambda job: job.row.prefill_remaining)
    for job in jobs:
        job.passed_over = 0 if job is chosen else job.passed_over + 1
    return chosen


def _awaits_snapshot(cmd: Generate, job: _Job) -> bool:
    """Whether `job` will store a snapshot of a prefix of `cmd`'s prompt that it has not stored yet."""
    at = job.row.snapshot_at
    return (at is not None and cmd.adapter == job.cmd.adapter and job.row.fed < at < len(cmd.prompt_ids)
            and cmd.prompt_ids[:at] == job.cmd.prompt_ids[:at])


def _left(cmd: Generate) -> bool:
    """Whether the request's session went away (it closed its end of the reply channel)."""
    return cmd.reply.statistics().open_receive_channels == 0
