"""The engine subtree: the GPU lease and the lane's actors, under one rest_for_one supervisor.

    engine (rest_for_one)     later children hold state that belongs to earlier ones
    ├── gpu-lease             one OS thread owns every MLX call; loads the model; step watchdog
    ├── decode-step           DecodeStepActor: the running batch
    ├── prefill               PrefillActor: solo or cohort prefill, token 0
    ├── admission             AdmissionActor: FIFO queue, row cap, KV budget
    └── cache-persistence     CachePersistenceActor: the prompt cache's SSD tier (BlockPersistenceActor under --kv-layout paged)

Every `--batch` runs this lane; `--batch 1` caps it at one row. The actors
and what they share live in one `Lane` record (actors/lane.py); the
`_start_*` methods below are the whole wiring: each builds its actor from
the lane and the actors started before it, and puts it in the lane.

Every actor reports started at once and waits for the model inside its run,
so the tree (and /health, saying "loading model: " and the phase: reading
weights, the draft model, adapters, warming up) is up while the model loads;
each phase is logged as it starts. The model is loaded once; a restarted lease reuses its evaluated
weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import attrs
import trio

from mlx_trio.actors.admission import AdmissionActor, Limits
from mlx_trio.actors.block_persistence import BlockPersistenceActor, block_store_opener
from mlx_trio.actors.cache_persistence import ACTOR_ID as PERSISTENCE_ID
from mlx_trio.actors.cache_persistence import CachePersistenceActor, PersistenceStatistics, store_opener
from mlx_trio.actors.decode_step import DecodeStepActor, speculation_for
from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.actors.lane import Lane
from mlx_trio.actors.memory_budget import MemoryBudget
from mlx_trio.actors.messages import Generate
from mlx_trio.actors.prefill import PrefillActor, starts_cached
from mlx_trio.actors.prompt_caching import PromptCaching
from mlx_trio.actors.rank_watch import RankWatch
from mlx_trio.actors.row_cap import AUTO_CEILING, AUTO_CONTEXT_TOKENS, AUTO_FLOOR, auto_row_cap
from mlx_trio.config import AUTO, PAGED, EngineConfig, KvLayoutChoice, choose_kv_layout
from mlx_trio.engine.batch.warmup import warm_up_gpu
from mlx_trio.engine.distributed.leader import leader_for
from mlx_trio.engine.distributed.world import current_world
from mlx_trio.engine.kv.kv_scheme import KvScheme
from mlx_trio.engine.kv.layout import default_kv_budget
from mlx_trio.engine.lease_thread import chosen_backend, prepare_thread, release_thread_streams
from mlx_trio.engine.adapters.resident import ResidentAdapters
from mlx_trio.engine.model.draft_model import with_draft_model
from mlx_trio.engine.model.load import LoadedModel, load_model, paged_kernel_off, paged_refusals, with_paged_kv
from mlx_trio.engine.prompt_cache.divergence import Divergence
from mlx_trio.engine.prompt_cache.ram_tier import PromptCacheStatistics
from mlx_trio.errors import AdapterError, EngineFailure, MlxTrioError, ModelLoadError
from mlx_trio.events import CacheDivergence
from mlx_trio.supervision import Backoff, ChildSpec, Retrying, Strategy, Supervisor
from mlx_trio.supervision.faults import Faults

log = logging.getLogger("mlx_trio.engine")

# Default RAM-tier size: this fraction of the KV budget (live rows take it back on demand).
DEFAULT_PROMPT_CACHE_FRACTION = 0.25
# An actor that crashes again within a second of its restart waits 10 ms, 20 ms, ... up to
# 100 ms before the next one: a crash loop slows to ~10 restarts/s and trips the intensity
# (--max-restarts), while faults a few tenths of a second apart never wait.
ACTOR_BACKOFF = Backoff(first_s=0.01, max_s=0.1, quick_s=1.0)


# /health says the lease stalled once one job has run this share of --step-watchdog with work waiting:
# long before the watchdog gives up on it (300 s by default: 503 after 30 s), far past any step.
LEASE_STALL_FRACTION = 0.1


class LeaseWedged(EngineFailure):
    """A lease job ran past the step watchdog; the lease thread was abandoned."""


@attrs.define
class RetiredCounts:
    """What the lane's earlier actor incarnations counted: each actor's own counts start from 0 when it
    restarts, so its successor's are added to these (`EngineActors.counters`), and no total goes back."""

    decode_steps: int = 0
    decoded_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    prefill_tokens: int = 0
    snapshots: int = 0
    submitted: int = 0

    def retire(self, lane: Lane, actor: str) -> None:
        """Keep the counts of `lane`'s `actor` ("decode-step", "prefill" or "admission"), about to be replaced."""
        if actor == "decode-step" and lane.decode_step is not None:
            decode = lane.decode_step.statistics()
            self.decode_steps += decode.decode_steps
            self.decoded_tokens += decode.tokens_decoded
            self.proposed += decode.proposed
            self.accepted += decode.accepted
        elif actor == "prefill" and lane.prefill is not None:
            prefill = lane.prefill.statistics()
            self.prefill_tokens += prefill.prefill_tokens
            self.snapshots += prefill.snapshots
        elif actor == "admission" and lane.admission is not None:
            self.submitted += lane.admission.statistics().submitted


class EngineActors:
    """Builds, supervises and exposes the engine subtree (`supervisor`) and its `lane`."""

    def __init__(self, config: EngineConfig, faults: Faults) -> None:
        self.config = config
        self.lane = Lane(config, faults)
        self._retired = RetiredCounts()
        self._budget: int | None = None
        self._started = time.monotonic()  # when loading began (start-up progress)
        world = current_world()
        # Scale-out only: rank 0's heartbeat over its followers (actors/rank_watch.py); last, so under
        # rest_for_one its crash restarts only itself.
        self.ranks = RankWatch(self.lane, world, heartbeat_s=config.heartbeat_s,
                               deadline_s=config.collective_timeout_s) if world.distributed else None
        watch = [ChildSpec("rank-watch", self._run_rank_watch, kind="rank-watch")] if self.ranks else []
        self.supervisor = Supervisor(
            "engine",
            [
                ChildSpec("gpu-lease", self._run_lease, kind="gpu-lease", shutdown_s=15.0),
                ChildSpec("decode-step", self._run_decode_step, kind="decode-step"),
                ChildSpec("prefill", self._run_prefill, kind="prefill"),
                ChildSpec("admission", self._run_admission, kind="admission"),
                # Last: under rest_for_one its crash restarts only itself (it is only a cache).
                ChildSpec(PERSISTENCE_ID, self._run_persistence, kind=PERSISTENCE_ID),
                *watch,
            ],
            strategy=Strategy.REST_FOR_ONE,
            max_restarts=config.max_restarts,
            period_s=config.restart_period_s,
            backoff=ACTOR_BACKOFF,
        )
        # The root's child: when the subtree gives up, the engine is down (health says why,
        # new requests are refused) and starts again after a backoff; the process lives on.
        self.retrying = Retrying(self.supervisor)

    @property
    def model(self) -> LoadedModel | None:
        return self.lane.model

    @property
    def submit_target(self) -> AdmissionActor | None:
        """Where a session submits `Generate`: the lane's admission."""
        return self.lane.admission

    @property
    def group_lost(self) -> str | None:
        """Scale-out only: why rank 0 lost its group, which never comes back in this process (docs/scale-out.md)."""
        return self.ranks.lost if self.ranks is not None else None

    def health(self) -> tuple[bool, str]:
        """(ok, reason): ok only when the model is loaded and every engine actor runs."""
        lane = self.lane
        if lane.load_error is not None:
            return False, f"model failed to load: {lane.load_error}"
        if lane.model is None:
            return False, lane.startup  # "loading model: <the phase>"
        if self.group_lost is not None:
            return False, f"scale-out group lost: {self.group_lost}"
        down = self.retrying.down
        if down is not None:
            return False, f"engine down: {down.reason}; starting again in {down.retry_in_s():.0f} s"
        state, down = self.supervisor.liveness()
        if state != "running" or down:
            return False, f"engine actors not running: {', '.join(down) or state}"
        stalled = self._lease_stalled_s()
        if stalled is not None:
            return False, f"gpu-lease stalled {stalled:.0f} s: one job has run that long while requests wait"
        return True, "ok"

    def _lease_stalled_s(self) -> float | None:
        """How long the lease's running job has run, when that is past `LEASE_STALL_FRACTION` of the
        step watchdog while work waits for it: queued jobs, or requests in flight (a decode step chain
        queues its next job only when one ends). Every stream is frozen then, though every actor runs."""
        lease = self.lane.lease
        stats = lease.statistics() if lease is not None else None
        if stats is None or stats.running_since is None or not (stats.queue_depth or self.lane.in_flight()):
            return None
        age = time.monotonic() - stats.running_since
        return age if age > self.config.step_watchdog_s * LEASE_STALL_FRACTION else None

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise `ModelLoadError` if it never will be."""
        await self.lane.wait_ready()

    async def drain_persistence(self) -> None:
        """Wait until the SSD tier has written what it was offered (graceful shutdown)."""
        if self.lane.persistence is not None:
            await self.lane.persistence.drain()

    # -- counters ----------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """The lane's counters plus the lease's (`/stats.batch` and `/v1/status` read these).

        `mode` is "batch" when rows may share steps, "serial" when the lane
        runs one row at a time (`--batch 1`, or a model whose caches cannot merge).
        The totals (submitted rows, decode steps, tokens, proposals) count since the
        engine started, across actor restarts (`RetiredCounts`).
        """
        lane, retired = self.lane, self._retired
        lease = lane.lease.statistics() if lane.lease is not None else None
        decode = lane.decode_step.statistics() if lane.decode_step is not None else None
        prefill = lane.prefill.statistics() if lane.prefill is not None else None
        admission = lane.admission.statistics() if lane.admission is not None else None
        paged = lane.model.paged_kv if lane.model is not None else None
        blocks = paged.counters() if paged is not None else None
        layout = lane.kv_layout
        return {
            # The row cap: `--batch N`, or auto's choice once the model is known (None before), and which it was.
            "configured": self.config.batch if self.config.batch is not None else lane.auto_rows,
            "auto": self.config.batch is None, "mode": "batch" if lane.row_cap > 1 else "serial",
            "active_rows": (decode.active_rows if decode else 0) + (1 if prefill and prefill.active_request else 0),
            "pending_rows": admission.mailbox_depth if admission else 0,
            "submitted_rows": retired.submitted + (admission.submitted if admission else 0),
            "kv_bytes": lane.rows_kv_bytes(),
            "kv_blocks": blocks,
            # --kv-layout's layout in force ("paged" or "padded") and why; None until the model is loaded.
            "kv_layout": layout.layout if layout is not None else None,
            "kv_layout_reason": layout.reason if layout is not None else None,
            "kv_budget_bytes": admission.budget_bytes if admission else None,
            "lease_queue_depth": lease.queue_depth if lease else 0,
            "lease_busy_fraction": lease.busy_fraction if lease else 0.0,
            "decode_steps": retired.decode_steps + (decode.decode_steps if decode else 0),
            "decoded_tokens": retired.decoded_tokens + (decode.tokens_decoded if decode else 0),
            "speculative_proposed": retired.proposed + (decode.proposed if decode else 0),
            "speculative_accepted": retired.accepted + (decode.accepted if decode else 0),
            # Prefill-only cuDNN: shapes planned so far, and whether idle time still plans more (actors/plan_warmup.py).
            "cudnn_plans": prefill.cudnn_plans if prefill else 0,
            "cudnn_plans_pending": prefill.cudnn_plans_pending if prefill else False,
            # The attention kernels the lease thread chose (engine/lease_thread.py): "mlx", "cudnn" or
            # "cudnn-prefill"; None before it started.
            "attention_backend": chosen_backend(),
        }

    def prompt_cache_counters(self) -> dict[str, Any]:
        """The prompt cache's tiers and the prefill work it saved (`/stats.prompt_cache`)."""
        lane = self.lane
        stats = lane.caching.statistics() if lane.caching is not None else PromptCacheStatistics()
        prefill = lane.prefill.statistics() if lane.prefill is not None else None
        # Before the first load under `auto` the tier's actor waits to know the layout (`_run_persistence`): a
        # configured tier is on all the same (a front's copy of this status, read then, arms its faults).
        ssd = (lane.persistence.statistics() if lane.persistence is not None else
               PersistenceStatistics(enabled=self.config.prompt_cache_dir is not None
                                     and not self.config.prompt_cache_off))
        last = self._described(lane.caching.divergences.last if lane.caching is not None else None)
        return {
            "enabled": lane.caching is not None, **attrs.asdict(stats),
            "last_divergence": attrs.asdict(last) if last is not None else None,
            "prefill_tokens": self._retired.prefill_tokens + (prefill.prefill_tokens if prefill else 0),
            "snapshots": self._retired.snapshots + (prefill.snapshots if prefill else 0),
            "ssd": {
                "enabled": ssd.enabled, "degraded": ssd.degraded, "entries": ssd.entries, "bytes": ssd.bytes,
                "reads": ssd.ssd_reads, "writes": ssd.ssd_writes, "errors": ssd.ssd_errors,
                "dropped": ssd.dropped, "queue_depth": ssd.queue_depth,
                "restore_failures": ssd.restore_failures, "reason": ssd.reason,
            },
        }

    def cache_divergence(self, prompt_ids: Sequence[int]) -> CacheDivergence | None:
        """Where `prompt_ids` left its closest prompt-cache entry at its last lookup, as text (then forgotten)."""
        caching = self.lane.caching
        return self._described(caching.divergences.take(prompt_ids) if caching is not None else None)

    def _described(self, divergence: Divergence | None) -> CacheDivergence | None:
        # The tokenizer is pure Python: decoding a few tokens here never waits on the GPU.
        model = self.lane.model
        return divergence.described(model.decode) if divergence is not None and model is not None else None

    # -- the children, in start order: the whole wiring ------------------------------

    async def _run_lease(self, *, task_status: trio.TaskStatus[GpuLease] = trio.TASK_STATUS_IGNORED) -> None:
        lane = self.lane
        # Under scale-out rank 0's lease sends every job to the follower ranks first (docs/scale-out.md).
        leader = leader_for(current_world())
        # Speculation's verify steps would meet cuDNN plans afresh: prefill-only cuDNN is off then.
        speculates = self.config.prompt_lookup or self.config.draft_model is not None
        lease = GpuLease(on_thread_start=partial(prepare_thread, speculates=speculates),
                         on_thread_exit=release_thread_streams, faults=lane.faults,
                         run_job=leader.run_job if leader is not None else None)
        async with trio.open_nursery() as nursery:
            await nursery.start(lease.serve)
            lane.lease = lease
            task_status.started(lease)
            if lane.model is None and lane.load_error is None:
                # Evaluated weights survive a lease restart; only the first start loads them.
                await self._load(lease)
            await self._watch(lease)

    async def _run_decode_step(self, *, task_status: trio.TaskStatus[DecodeStepActor] = trio.TASK_STATUS_IGNORED) -> None:
        lane = self.lane
        assert lane.lease is not None  # rest_for_one: the lease started first
        self._retired.retire(lane, "decode-step")
        lane.decode_step = DecodeStepActor(lane, lane.lease)
        await lane.decode_step.run(task_status=task_status)

    async def _run_prefill(self, *, task_status: trio.TaskStatus[PrefillActor] = trio.TASK_STATUS_IGNORED) -> None:
        lane = self.lane
        assert lane.lease is not None and lane.decode_step is not None
        self._retired.retire(lane, "prefill")
        lane.prefill = PrefillActor(lane, lane.lease, join=lane.decode_step.join_send)
        await lane.prefill.run(task_status=task_status)

    async def _run_admission(self, *, task_status: trio.TaskStatus[AdmissionActor] = trio.TASK_STATUS_IGNORED) -> None:
        lane = self.lane
        assert lane.prefill is not None
        self._retired.retire(lane, "admission")
        lane.admission = AdmissionActor(lane, lane.prefill.inbox_send, self._admission_limits)
        await lane.admission.run(task_status=task_status)

    async def _run_persistence(self, *, task_status: trio.TaskStatus[CachePersistenceActor] = trio.TASK_STATUS_IGNORED) -> None:
        lane, directory = self.lane, self.config.prompt_cache_dir
        assert lane.lease is not None
        options: dict[str, Any] = dict(faults=lane.faults, io_timeout_s=self.config.prompt_cache_io_timeout_s)
        if self.config.kv_layout == AUTO and directory is not None and lane.kv_layout is None:
            # Entries or blocks follow the layout `auto` chooses at the first load: report started now, so the
            # tree's start never waits for the load (no request reaches the tier before it), and choose once
            # loaded. A restart after it knows the layout (a reload chooses the same), so the tier is never
            # missing from the status while a restarted lease reloads.
            task_status.started(None)
            task_status = trio.TASK_STATUS_IGNORED
            await lane.wait_model()
        paged = lane.kv_layout.paged if lane.kv_layout is not None else self.config.kv_layout == PAGED
        if paged:  # the pool's cached blocks are the prompt cache: the SSD tier stores blocks
            blocks = (block_store_opener(lane.lease, lane.wait_model, directory, self.config.prompt_cache_ssd_bytes)
                      if directory is not None else None)
            lane.persistence = BlockPersistenceActor(lane.lease, blocks, lane.wait_model, **options)
        else:
            opener = (store_opener(lane.lease, lane.wait_model, directory, self.config.prompt_cache_ssd_bytes,
                                   self.config.prefill_step_size)
                      if directory is not None and not self.config.prompt_cache_off else None)
            lane.persistence = CachePersistenceActor(lane.lease, opener, **options)
        await lane.persistence.run(task_status=task_status)

    async def _run_rank_watch(self, *, task_status: trio.TaskStatus[RankWatch] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.ranks is not None
        await self.ranks.run(task_status=task_status)

    # -- the lease's jobs: load, warm up, watch ----------------------------------------

    async def _watch(self, lease: GpuLease) -> None:
        """The step watchdog: a job running past `step_watchdog_s` means the thread is wedged.

        The lease is abandoned (its waiters get LeaseClosed) and this actor
        crashes, so the supervisor starts a new lease thread and, rest_for_one,
        fresh actors after it; sessions resume on them.
        """
        limit = self.config.step_watchdog_s
        while True:
            await trio.sleep(min(limit / 4, 1.0))
            since = lease.statistics().running_since
            if since is not None and time.monotonic() - since > limit:
                lease.abandon()
                raise LeaseWedged(f"a lease job ran longer than the {limit:g} s step watchdog")

    def _phase(self, what: str) -> None:
        """Name the start-up phase now running: in /health's reason and in the log, with the seconds so far."""
        self.lane.startup = f"loading model: {what}"
        log.info("start-up: %s (%.1f s)", what, time.monotonic() - self._started)

    async def _load(self, lease: GpuLease) -> None:
        self._started = time.monotonic()
        model_name = self.config.model
        self._phase(f"reading the weights of {model_name}" if model_name is not None
                    else "reading the bundled model's weights (converting it first, the first time)")
        try:
            model = await lease.run(partial(load_model, self.config.model, cache_dir=self.config.cache_dir,
                                            kv_scheme=kv_scheme_of(self.config),
                                            # A compiled trace holds the layers and their arrays as
                                            # constants: never while adapters wrap layers at run time.
                                            compile_decode=False if self.config.serves_adapters
                                            else self.config.compile_decode,
                                            # Adapters wrap q_proj, v_proj, ... by name: keep them apart.
                                            fuse_projections=not self.config.serves_adapters))
            log.info("model %s loaded from %s", model.model_id, model.path)
            choice = await self._choose_kv_layout(lease, model)
            if choice.paged:  # the pool takes the whole KV budget now (docs/design.md §6.5)
                model = await lease.run(partial(with_paged_kv, model, self._kv_budget(model)))
            if self.config.draft_model is not None:
                self._phase(f"reading the draft model {self.config.draft_model}")
                model = await lease.run(partial(with_draft_model, model, self.config.draft_model,
                                                cache_dir=self.config.cache_dir))
                log.info("draft model %s loaded", self.config.draft_model)
            if self.config.serves_adapters:
                self._phase(f"loading {len(self.config.lora_modules)} adapter(s)")
                self.lane.adapters = await self._load_adapters(lease, model)
            self._choose_row_cap(model)
            self._phase("done; serving once every actor runs")
        except Exception as exc:
            # Retrying cannot fix a missing or broken model: report it instead of restarting.
            error = exc if isinstance(exc, MlxTrioError) else ModelLoadError(f"loading the model failed: {exc!r}")
            log.error("%s", error)
            self.lane.settle_model(None, error)
            return
        self.lane.settle_model(model)
        # Every --batch runs the batch lane (B=1 too). Its kernels compile in the first lease job after
        # readiness, not before it (issue #46): /health does not wait, and a request arriving meanwhile
        # waits for that one job, about what its own first steps would have paid to compile them.
        await self._warm_up(lease, model)

    async def _choose_kv_layout(self, lease: GpuLease, model: LoadedModel) -> KvLayoutChoice:
        """--kv-layout's layout for `model` (`choose_kv_layout`), logged once and kept for `/v1/status`; raises
        ModelLoadError naming the conflict when `paged` cannot serve (the config refused its flags already)."""
        # Module functions, not a lambda: under scale-out every lease job is pickled to the followers.
        refusals, kernel_off = await lease.run(paged_refusals, model), await lease.run(paged_kernel_off, model)
        try:
            choice = choose_kv_layout(self.config.kv_layout, [*self.config.paged_conflicts, *refusals], kernel_off)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        log.info("KV layout: %s", choice)
        self.lane.kv_layout = choice
        return choice

    async def _load_adapters(self, lease: GpuLease, model: LoadedModel) -> ResidentAdapters:
        """The served adapters (`--lora-modules`); one that cannot be served is logged and left out."""
        config = self.config
        adapters = ResidentAdapters(model.model, max_loras=config.max_loras, max_rank=config.max_lora_rank)
        for name, path in config.lora_modules:
            try:
                weights = await lease.run(adapters.load, name, path)
            except AdapterError as exc:
                log.error("not serving adapter %s: %s", name, exc)
                continue
            log.info("adapter %s (%s, rank %d, %d layers) from %s", name, weights.kind, weights.rank,
                     len(weights.layers), path)
        return adapters

    async def _warm_up(self, lease: GpuLease, model: LoadedModel) -> None:
        """Compile the lane's kernels in one lease job once serving (engine/batch/warmup.py); serve even if it fails.

        Runs before the watchdog starts, as it did before readiness: a slow first compile is not a wedged step.
        """
        start = time.monotonic()
        try:
            ran = await lease.run(warm_up_gpu, model.model, model.vocab_size, model.kv_scheme,
                                  model.compile_decode, speculation_for(self.config, model), model.paged_kv)
        except Exception:
            log.warning("warming up the batch lane failed; the first requests may stall while kernels compile",
                        exc_info=True)
            return
        if ran:
            log.info("batch lane warmed up in %.1f s (after readiness: requests that came meanwhile waited for it)",
                     time.monotonic() - start)

    # -- admission's limits and the prompt cache, once the model is known -------------------

    def _choose_row_cap(self, model: LoadedModel) -> None:
        """`--batch auto`: the row cap from the KV budget and the model (actors/row_cap.py), before the model
        settles, so the actors waiting for it (decode-step's batch, admission's limits) see the cap."""
        if self.config.batch is not None or self.lane.auto_rows is not None:
            return
        budget = self._kv_budget(model)
        self.lane.auto_rows = auto_row_cap(budget, model.kv_layout.row_bytes)
        log.info("--batch auto: %d rows (%.1f GiB of KV budget, %.0f MiB per row of %d tokens, within %d..%d; "
                 "set --batch N to choose)", self.lane.auto_rows, budget / 2**30,
                 model.kv_layout.row_bytes(AUTO_CONTEXT_TOKENS) / 2**20, AUTO_CONTEXT_TOKENS, AUTO_FLOOR, AUTO_CEILING)

    async def _admission_limits(self) -> Limits:
        lane = self.lane
        model = await lane.wait_model()
        layout, step = model.kv_layout, self.config.prefill_step_size
        budget = self._kv_budget(model)
        if lane.memory is None and lane.lease is not None:
            lane.memory = MemoryBudget(budget)
        if lane.caching is None and layout.batchable:
            lane.caching = self._make_caching(budget, paged=model.paged_kv is not None)
        paged = model.paged_kv
        if paged is not None:  # admission counts blocks: what is admitted always has its blocks in the pool
            # A verify forward may write its proposals past a row's last token before they are rolled back.
            margin = self.config.num_draft_tokens if self.config.prompt_lookup else 0

            async def pin_prefix(cmd: Generate, fits: Callable[[frozenset[int]], bool]) -> Any:
                if lane.lease is None:
                    return None
                # No cached first block (under the row's revision), nothing to pin: no lease job. A wave of fresh
                # prompts then reaches the prefill actor together (its cohorts), not one a lease round trip behind
                # the other's prefill.
                if not starts_cached(paged, lane, cmd):
                    return None

                def job() -> Any:
                    # An adapter row's blocks are keyed under its revision, read here on the lease thread (where a
                    # load replaces it) as its join reads it: `Engine.load_adapter` refuses to replace a name while
                    # a request names it, so the two readings agree.
                    revision = lane.kv_revision(cmd.adapter)
                    if revision is None:
                        return None  # no longer served: its row fails when it takes the adapter
                    pin = paged.pin_prefix(cmd.prompt_ids, revision)
                    if pin.blocks and fits(frozenset(pin.blocks)):
                        return pin
                    paged.unpin(pin)
                    return None

                return await lane.lease.run(job)

            return Limits(
                pin_prefix=pin_prefix, block_bytes=paged.row_bytes(1),
                project_bytes=lambda cmd: paged.row_bytes(len(cmd.prompt_ids) + cmd.params.max_tokens + margin),
                transient_bytes=lambda cmd: layout.prefill_peak_bytes(len(cmd.prompt_ids), step),
                budget_bytes=paged.capacity_bytes,
                max_rows=lane.row_cap,
            )
        return Limits(
            project_bytes=lambda cmd: layout.row_bytes(len(cmd.prompt_ids) + cmd.params.max_tokens),
            transient_bytes=lambda cmd: layout.prefill_peak_bytes(len(cmd.prompt_ids), step),
            budget_bytes=budget,
            max_rows=lane.row_cap,
        )

    def _kv_budget(self, model: LoadedModel) -> int:
        """The KV ceiling shared by live rows and the prompt cache; derived once (free memory changes as we run)."""
        if self._budget is None:
            self._budget = self.config.kv_budget_bytes
            if self._budget is None:
                self._budget = default_kv_budget(model.weights_bytes)
                log.info("KV budget %.1f GiB (free device memory less headroom; set --kv-budget to change)",
                         self._budget / 2**30)
        return self._budget

    def _make_caching(self, budget: int, *, paged: bool) -> PromptCaching | None:
        max_bytes = self.config.prompt_cache_bytes
        if max_bytes is None:
            max_bytes = int(budget * DEFAULT_PROMPT_CACHE_FRACTION)
        if paged:
            log.info("prompt cache off: the paged layout's cached prefix blocks are the prompt cache")
            return None
        if self.config.prompt_cache_off or max_bytes <= 0:
            log.info("prompt cache off")
            return None
        log.info("prompt cache: up to %.1f MiB and %d entries in RAM, within the KV budget "
                 "(--prompt-cache-bytes, --prompt-cache-size)", max_bytes / 2**20, self.config.prompt_cache_size)
        return PromptCaching(self.lane, max_bytes=max_bytes, max_entries=self.config.prompt_cache_size)


def kv_scheme_of(config: EngineConfig) -> KvScheme:
    """The KV storage format the flags ask for (raises ValueError for values mlx cannot quantize with)."""
    return KvScheme(bits=config.kv_bits, group_size=config.kv_group_size, start=config.quantized_kv_start)
