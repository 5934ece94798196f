"""The engine subtree: the GPU lease and the actors of one lane, under one rest_for_one supervisor.

    engine (rest_for_one)     later children hold state that belongs to earlier ones
    ├── gpu-lease             one OS thread owns every MLX call; loads the model; step watchdog
    │   --batch N > 1:
    ├── decode-step           DecodeStepActor: the running batch
    ├── prefill               PrefillActor: solo prefill, token 0
    └── admission             AdmissionActor: FIFO queue, row cap, KV budget
    │   --batch 1:
    └── decode-step           SerialDecodeActor: the strict serial lane

Every actor reports started at once and waits for the model inside its run,
so the tree (and /health, saying "loading model") is up while the model
loads. The model is loaded once; a restarted lease reuses its evaluated
weights. `EngineActors` also holds the current handle of each actor (a
restart replaces them) and the lane's counters for `/stats`.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import attrs
import trio

from mlx_trio.actors.admission import AdmissionActor, Limits
from mlx_trio.actors.decode_step import DecodeStepActor
from mlx_trio.actors.cache_persistence import ACTOR_ID as PERSISTENCE_ID
from mlx_trio.actors.cache_persistence import CachePersistenceActor, PersistenceStatistics, store_opener
from mlx_trio.actors.decode import DecodeStatistics, SerialDecodeActor
from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.actors.prefill import PrefillActor
from mlx_trio.actors.prompt_caching import PromptCaching
from mlx_trio.config import EngineConfig
from mlx_trio.engine.kv.layout import default_kv_budget
from mlx_trio.engine.lease_thread import prepare_thread, release_thread_streams
from mlx_trio.engine.model.load import LoadedModel, load_model
from mlx_trio.engine.prompt_cache.ram_tier import PromptCacheStatistics
from mlx_trio.engine.batch.warmup import warm_up_gpu
from mlx_trio.errors import EngineFailure, MlxTrioError, ModelLoadError
from mlx_trio.supervision import ChildSpec, Strategy, Supervisor
from mlx_trio.supervision.faults import Faults

log = logging.getLogger("mlx_trio.engine")

# Default RAM-tier size: this fraction of the KV budget (live rows take it back on demand).
DEFAULT_PROMPT_CACHE_FRACTION = 0.25


class LeaseWedged(EngineFailure):
    """A lease job ran past the step watchdog; the lease thread was abandoned."""


class EngineActors:
    """Builds, supervises and exposes the engine subtree (`supervisor`)."""

    def __init__(self, config: EngineConfig, faults: Faults) -> None:
        self.config = config
        self.faults = faults
        self.model: LoadedModel | None = None
        self.load_error: MlxTrioError | None = None
        self._model_settled = trio.Event()  # set once loading succeeded or failed for good
        self.lease: GpuLease | None = None
        self.decoder: SerialDecodeActor | DecodeStepActor | None = None
        self.prefill: PrefillActor | None = None
        self.admission: AdmissionActor | None = None
        self.persistence: CachePersistenceActor | None = None
        # The prompt cache outlives actor restarts; created once the KV budget is known.
        self.caching: PromptCaching | None = None
        self._budget: int | None = None
        self.supervisor = Supervisor(
            "engine",
            [ChildSpec("gpu-lease", self._run_lease, kind="gpu-lease", shutdown_s=15.0), *self._lane_children()],
            strategy=Strategy.REST_FOR_ONE,
            max_restarts=config.max_restarts,
            period_s=config.restart_period_s,
        )

    def _lane_children(self) -> list[ChildSpec]:
        """--batch 1: the strict serial lane. Otherwise the batch lane: decode-step ← prefill ← admission."""
        if self.config.batch == 1:
            return [ChildSpec("decode-step", self._run_serial_decoder, kind="decode-step")]
        return [
            ChildSpec("decode-step", self._run_batch_decoder, kind="decode-step"),
            ChildSpec("prefill", self._run_prefill, kind="prefill"),
            ChildSpec("admission", self._run_admission, kind="admission"),
            # Last: under rest_for_one its crash restarts only itself (it is only a cache).
            ChildSpec(PERSISTENCE_ID, self._run_persistence, kind=PERSISTENCE_ID),
        ]

    @property
    def submit_target(self) -> SerialDecodeActor | AdmissionActor | None:
        """Where a session submits `Generate`: the serial decoder, or admission on the batch lane."""
        return self.decoder if self.config.batch == 1 else self.admission  # type: ignore[return-value]

    def health(self) -> tuple[bool, str]:
        """(ok, reason): ok only when the model is loaded and every engine actor runs."""
        if self.load_error is not None:
            return False, f"model failed to load: {self.load_error}"
        if self.model is None:
            return False, "loading model"
        status = self.supervisor.status()
        down = [c["id"] for c in status["children"] if c["state"] != "running"]
        if status["state"] != "running" or down:
            return False, f"engine actors not running: {', '.join(down) or status['state']}"
        return True, "ok"

    def counters(self) -> dict[str, Any]:
        """The lane's counters plus the lease's (`/stats.batch` and `/v1/status` read these)."""
        lease = self.lease.statistics() if self.lease is not None else None
        return {
            **self._lane_counters(),
            "lease_queue_depth": lease.queue_depth if lease else 0,
            "lease_busy_fraction": lease.busy_fraction if lease else 0.0,
        }

    def prompt_cache_counters(self) -> dict[str, Any]:
        """The prompt cache's tiers and the prefill work it saved (`/stats.prompt_cache`)."""
        stats = self.caching.statistics() if self.caching is not None else PromptCacheStatistics()
        prefill = self.prefill.statistics() if self.prefill is not None else None
        ssd = self.persistence.statistics() if self.persistence is not None else PersistenceStatistics()
        return {
            "enabled": self.caching is not None, **attrs.asdict(stats),
            "prefill_tokens": prefill.prefill_tokens if prefill else 0,
            "snapshots": prefill.snapshots if prefill else 0,
            "ssd": {
                "enabled": ssd.enabled, "degraded": ssd.degraded, "entries": ssd.entries, "bytes": ssd.bytes,
                "reads": ssd.ssd_reads, "writes": ssd.ssd_writes, "errors": ssd.ssd_errors,
                "dropped": ssd.dropped, "queue_depth": ssd.queue_depth,
            },
        }

    def _lane_counters(self) -> dict[str, Any]:
        """Rows and KV bytes of whichever lane runs (`/stats.batch` reads these)."""
        decoder = self.decoder.statistics() if self.decoder is not None else None
        if isinstance(decoder, DecodeStatistics) or decoder is None:
            return {
                "configured": self.config.batch, "mode": "off",  # --batch 1: the strict serial lane
                "active_rows": 1 if decoder and decoder.active_request else 0,
                "pending_rows": decoder.mailbox_depth if decoder else 0,
                "submitted_rows": decoder.submitted if decoder else 0,
                "kv_bytes": decoder.active_kv_bytes if decoder else 0,
                "kv_budget_bytes": None,
            }
        prefill = self.prefill.statistics() if self.prefill is not None else None
        admission = self.admission.statistics() if self.admission is not None else None
        batchable = self.model is None or self.model.kv_layout.batchable
        return {
            "configured": self.config.batch, "mode": "batch" if batchable else "serial",
            "active_rows": decoder.active_rows + (1 if prefill and prefill.active_request else 0),
            "pending_rows": admission.mailbox_depth if admission else 0,
            "submitted_rows": admission.submitted if admission else 0,
            "kv_bytes": decoder.kv_bytes + (prefill.active_kv_bytes if prefill else 0),
            "kv_budget_bytes": admission.budget_bytes if admission else None,
        }

    async def _run_lease(self, *, task_status: trio.TaskStatus[GpuLease] = trio.TASK_STATUS_IGNORED) -> None:
        lease = GpuLease(on_thread_start=prepare_thread, on_thread_exit=release_thread_streams,
                         faults=self.faults)
        async with trio.open_nursery() as nursery:
            await nursery.start(lease.serve)
            self.lease = lease
            task_status.started(lease)
            if self.model is None and self.load_error is None:
                # Evaluated weights survive a lease restart; only the first start loads them.
                await self._load(lease)
            await self._watch(lease)

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

    async def _load(self, lease: GpuLease) -> None:
        try:
            self.model = await lease.run(partial(load_model, self.config.model, cache_dir=self.config.cache_dir))
            log.info("model %s loaded from %s", self.model.model_id, self.model.path)
            if self.config.batch > 1:
                await self._warm_up(lease, self.model)
        except Exception as exc:
            # Retrying cannot fix a missing or broken model: report it instead of restarting.
            error = exc if isinstance(exc, MlxTrioError) else ModelLoadError(f"loading the model failed: {exc!r}")
            log.error("%s", error)
            self.load_error = error
        self._model_settled.set()

    async def _warm_up(self, lease: GpuLease, model: LoadedModel) -> None:
        """Compile the batch lane's kernels before the first request (engine/batch/warmup.py); serve even if it fails."""
        start = time.monotonic()
        try:
            ran = await lease.run(warm_up_gpu, model.model, model.vocab_size)
        except Exception:
            log.warning("warming up the batch lane failed; the first requests may stall while kernels compile",
                        exc_info=True)
            return
        if ran:
            log.info("batch lane warmed up in %.1f s", time.monotonic() - start)

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise `ModelLoadError` if it never will be."""
        await self._model_settled.wait()
        if self.load_error is not None:
            raise self.load_error

    async def _run_serial_decoder(self, *, task_status: trio.TaskStatus[SerialDecodeActor] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.lease is not None  # rest_for_one: the lease started first
        decoder = SerialDecodeActor(self.lease, self._wait_model, max_queue=self.config.max_queue,
                                    prefill_step_size=self.config.prefill_step_size, faults=self.faults)
        self.decoder = decoder
        await decoder.run(task_status=task_status)

    def _release(self, request_id: str) -> None:
        if self.admission is not None:
            self.admission.release(request_id)

    async def _run_batch_decoder(self, *, task_status: trio.TaskStatus[DecodeStepActor] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.lease is not None
        decoder = DecodeStepActor(self.lease, self._wait_model, release=self._release, max_rows=self.config.batch,
                                   faults=self.faults, get_caching=lambda: self.caching)
        self.decoder = decoder
        await decoder.run(task_status=task_status)

    async def _run_prefill(self, *, task_status: trio.TaskStatus[PrefillActor] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.lease is not None and isinstance(self.decoder, DecodeStepActor)
        prefill = PrefillActor(self.lease, self._wait_model, join=self.decoder.join_send, release=self._release,
                               max_rows=self.config.batch, prefill_step_size=self.config.prefill_step_size,
                               faults=self.faults, get_caching=lambda: self.caching,
                               decoding=lambda: bool(self.decoder and self.decoder.statistics().active_rows))
        self.prefill = prefill
        await prefill.run(task_status=task_status)

    async def _run_admission(self, *, task_status: trio.TaskStatus[AdmissionActor] = trio.TASK_STATUS_IGNORED) -> None:
        assert isinstance(self.decoder, DecodeStepActor) and self.prefill is not None
        decoder, prefill = self.decoder, self.prefill
        admission = AdmissionActor(
            prefill.inbox_send, get_limits=self._admission_limits, max_rows=self.config.batch,
            max_queue=self.config.max_queue, in_flight=lambda: decoder.in_flight() + prefill.in_flight(),
            faults=self.faults, get_caching=lambda: self.caching,
        )
        self.admission = admission
        await admission.run(task_status=task_status)

    async def _admission_limits(self) -> Limits:
        model = await self._wait_model()
        layout, step = model.kv_layout, self.config.prefill_step_size
        budget = self._kv_budget(model)
        if self.caching is None and layout.batchable:
            self.caching = self._make_caching(budget)
        return Limits(
            project_bytes=lambda cmd: layout.row_bytes(len(cmd.prompt_ids) + cmd.params.max_tokens),
            transient_bytes=lambda cmd: layout.prefill_peak_bytes(len(cmd.prompt_ids), step),
            budget_bytes=budget,
            # A model whose caches cannot merge runs the batch lane one row at a time.
            max_rows=self.config.batch if layout.batchable else 1,
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

    def _make_caching(self, budget: int) -> PromptCaching | None:
        max_bytes = self.config.prompt_cache_bytes
        if max_bytes is None:
            max_bytes = int(budget * DEFAULT_PROMPT_CACHE_FRACTION)
        if self.config.prompt_cache_off or max_bytes <= 0:
            log.info("prompt cache off")
            return None
        log.info("prompt cache: up to %.1f MiB and %d entries in RAM, within the KV budget "
                 "(--prompt-cache-bytes, --prompt-cache-size)", max_bytes / 2**20, self.config.prompt_cache_size)
        return PromptCaching(
            max_bytes=max_bytes, max_entries=self.config.prompt_cache_size, get_lease=lambda: self.lease,
            get_persistence=lambda: self.persistence,
            room=lambda: self.admission.unreserved_bytes() if self.admission is not None else None,
        )

    async def _run_persistence(self, *, task_status: trio.TaskStatus[CachePersistenceActor] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.lease is not None
        directory = self.config.prompt_cache_dir
        opener = (store_opener(self.lease, self._wait_model, directory, self.config.prompt_cache_ssd_bytes)
                  if directory is not None and not self.config.prompt_cache_off else None)
        persistence = CachePersistenceActor(self.lease, opener, faults=self.faults)
        self.persistence = persistence
        await persistence.run(task_status=task_status)

    async def drain_persistence(self) -> None:
        """Wait until the SSD tier has written what it was offered (graceful shutdown)."""
        if self.persistence is not None:
            await self.persistence.drain()

    async def _wait_model(self) -> LoadedModel:
        """The loaded model; if loading failed for good, wait forever (health reports why) instead of crash-looping."""
        await self._model_settled.wait()
        if self.model is None:
            await trio.sleep_forever()
        return self.model

