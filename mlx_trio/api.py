"""The embeddable API: `async with open_engine(...) as engine`.

The engine is a supervision tree of Trio actors:

    root (one_for_one)
    ├── engine (rest_for_one)      the lease must outlive what depends on it
    │   ├── gpu-lease              one OS thread owns every MLX call; loads the model
    │   └── decode-step            the serial decoder (the --batch 1 path)
    └── sessions (one_for_one)     one temporary session actor per request

`Engine.generate` validates and tokenizes in the caller (so bad input raises
there and never reaches an actor), starts a session, and yields its events.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import trio

from mlx_trio.actors.admission import AdmissionActor, Limits
from mlx_trio.actors.batch_decode import BatchDecodeActor
from mlx_trio.actors.decode import DecodeStatistics, SerialDecodeActor
from mlx_trio.actors.messages import Generate
from mlx_trio.actors.prefill import PrefillActor
from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.actors.session import MAX_RESUMES, Request, SessionActor, SessionOutput
from mlx_trio.config import EngineConfig
from mlx_trio.engine.lease_thread import release_thread_streams
from mlx_trio.engine.kv_layout import default_kv_budget
from mlx_trio.engine.model import LoadedModel, load_model
from mlx_trio.errors import (
    ActorCrashed, ContextTooLong, EngineFailure, EngineRestarted, InvalidParameter, MlxTrioError, ModelLoadError,
)
from mlx_trio.events import Completion, Finished, GenerationEvent, TextDelta
from mlx_trio.params import SamplingParams
from mlx_trio.supervision import ChildSpec, Restart, Strategy, Supervisor
from mlx_trio.supervision.faults import Faults

log = logging.getLogger("mlx_trio.engine")


class LeaseWedged(EngineFailure):
    """A lease job ran past the step watchdog; the lease thread was abandoned."""

Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]


class Engine:
    """A running engine. Create it with `open_engine`; all methods are Trio-side."""

    def __init__(self, config: EngineConfig, *, extra_children: Sequence[ChildSpec] = ()) -> None:
        self.config = config
        # Armed by tests and by POST /v1/admin/faults; actors check it at each message or step.
        self.faults = Faults()
        self._model: LoadedModel | None = None
        self._load_error: MlxTrioError | None = None
        self._model_settled = trio.Event()  # set once loading succeeded or failed for good
        self._lease: GpuLease | None = None
        self._decoder: SerialDecodeActor | BatchDecodeActor | None = None
        self._prefill: PrefillActor | None = None
        self._admission: AdmissionActor | None = None
        self._request_ids = itertools.count(1)
        self._engine_sup = Supervisor(
            "engine",
            [ChildSpec("gpu-lease", self._run_lease, kind="gpu-lease", shutdown_s=15.0), *self._lane_children()],
            strategy=Strategy.REST_FOR_ONE,
            max_restarts=config.max_restarts,
            period_s=config.restart_period_s,
        )
        # Sessions are temporary: a crashed session fails its own request only.
        self._sessions = Supervisor("sessions", strategy=Strategy.ONE_FOR_ONE, max_restarts=1_000_000, period_s=1.0)
        # `extra_children` (the HTTP server) start after the engine, so they can
        # serve /health while the model loads, and stop first on shutdown.
        self._root = Supervisor(
            "root",
            [self._engine_sup.as_child(), self._sessions.as_child(), *extra_children],
            strategy=Strategy.ONE_FOR_ONE,
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
        ]

    @property
    def _submit_target(self) -> SerialDecodeActor | AdmissionActor | None:
        return self._decoder if self.config.batch == 1 else self._admission  # type: ignore[return-value]

    # -- facts ---------------------------------------------------------------

    @property
    def model(self) -> LoadedModel:
        if self._model is None:
            raise EngineFailure("the model is not loaded yet")
        return self._model

    @property
    def model_id(self) -> str:
        return self.model.model_id

    def health(self) -> tuple[bool, str]:
        """(ok, reason): ok only when the model is loaded and every engine actor runs."""
        if self._load_error is not None:
            return False, f"model failed to load: {self._load_error}"
        if self._model is None:
            return False, "loading model"
        status = self._engine_sup.status()
        down = [c["id"] for c in status["children"] if c["state"] != "running"]
        if status["state"] != "running" or down:
            return False, f"engine actors not running: {', '.join(down) or status['state']}"
        return True, "ok"

    def status(self) -> dict[str, Any]:
        """The live supervision tree plus engine counters, as plain data."""
        lease = self._lease.statistics() if self._lease is not None else None
        return {
            "tree": self._root.status(),
            "model": self._model.model_id if self._model else None,
            "counters": {
                **self._lane_counters(),
                "lease_queue_depth": lease.queue_depth if lease else 0,
                "lease_busy_fraction": lease.busy_fraction if lease else 0.0,
            },
        }

    def _lane_counters(self) -> dict[str, Any]:
        """Rows and KV bytes of whichever lane runs (`/stats.batch` reads these)."""
        decoder = self._decoder.statistics() if self._decoder is not None else None
        if isinstance(decoder, DecodeStatistics) or decoder is None:
            return {
                "configured": self.config.batch, "mode": "off",  # --batch 1: the strict serial lane
                "active_rows": 1 if decoder and decoder.active_request else 0,
                "pending_rows": decoder.mailbox_depth if decoder else 0,
                "submitted_rows": decoder.submitted if decoder else 0,
                "kv_bytes": decoder.active_kv_bytes if decoder else 0,
                "kv_budget_bytes": None,
            }
        prefill = self._prefill.statistics() if self._prefill is not None else None
        admission = self._admission.statistics() if self._admission is not None else None
        batchable = self._model is None or self._model.kv_layout.batchable
        return {
            "configured": self.config.batch, "mode": "batch" if batchable else "serial",
            "active_rows": decoder.active_rows + (1 if prefill and prefill.active_request else 0),
            "pending_rows": admission.mailbox_depth if admission else 0,
            "submitted_rows": admission.submitted if admission else 0,
            "kv_bytes": decoder.kv_bytes + (prefill.active_kv_bytes if prefill else 0),
            "kv_budget_bytes": admission.budget_bytes if admission else None,
        }

    # -- requests -------------------------------------------------------------

    def prepare(self, prompt: Prompt, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                **sampling: Any) -> Request:
        """Validate and tokenize; raises `InvalidParameter` / `ContextTooLong` naming the field."""
        params = _merge_params(self.config.defaults, sampling).validate(vocab_size=self.model.vocab_size)
        if isinstance(prompt, str) and not prompt:
            raise InvalidParameter("prompt", "must not be empty")
        if not isinstance(prompt, str) and not isinstance(prompt, Sequence):
            raise InvalidParameter("prompt", f"must be a string, a list of messages or a list of token ids, got {type(prompt).__name__}")
        if not isinstance(prompt, str) and len(prompt) == 0:
            raise InvalidParameter("prompt", "must not be empty")
        ids = self.model.encode(prompt, chat_template_kwargs=chat_template_kwargs)
        if not ids:
            raise InvalidParameter("prompt", "tokenizes to no tokens")
        limit = self.model.context_length
        if limit is not None and len(ids) + params.max_tokens > limit:
            raise ContextTooLong(
                f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}, "
                f"together over the model's context of {limit} tokens; shorten the prompt or lower max_tokens",
                field="prompt" if isinstance(prompt, str) or isinstance(prompt[0], int) else "messages",
            )
        return Request(f"req-{next(self._request_ids)}", tuple(ids), params)

    async def generate(self, prompt: Prompt, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                       **sampling: Any) -> AsyncGenerator[GenerationEvent, None]:
        """Stream a generation: `PromptProgress`*, `TextDelta`*, then one `Finished`.

        Sampling keywords are `SamplingParams` fields. Leaving the loop early
        cancels the request and frees its KV cache.
        """
        request = self.prepare(prompt, chat_template_kwargs=chat_template_kwargs, **sampling)
        async for event in self.stream(request):
            yield event

    async def stream(self, request: Request) -> AsyncGenerator[GenerationEvent, None]:
        """Run an already prepared request (see `prepare`).

        If the session actor itself crashes, a new one carries on from the
        tokens the old one had received (up to `MAX_RESUMES` times), so the
        caller still sees one uninterrupted stream.
        """
        actor: SessionActor | None = None
        stalled = 0  # session crashes in a row that brought no new token
        while True:
            send, recv = trio.open_memory_channel[SessionOutput](0)  # rendezvous: the session waits for us
            actor = SessionActor(request, get_target=self._healthy_target, model=self.model, out=send,
                                 faults=self.faults, resume_from=actor)
            try:
                await self._sessions.start_child(
                    # A resumed session gets its own id: the crashed one may not be reaped yet.
                    ChildSpec(f"session-{request.request_id}" + (f".{actor.resumes}" if actor.resumes else ""),
                              actor.run, restart=Restart.TEMPORARY, kind="session")
                )
            except RuntimeError as exc:  # the sessions supervisor is not running: the tree is stopped
                raise EngineFailure("the engine is not running") from exc
            async with recv:
                async for item in recv:
                    if isinstance(item, MlxTrioError):
                        raise item
                    yield item
                    if isinstance(item, Finished):
                        return
            stalled = stalled + 1 if len(actor.generated) == actor.generated_at_start else 1
            if stalled > MAX_RESUMES:
                raise ActorCrashed(f"the session of request {request.request_id} crashed {stalled} times in a row")
            log.warning("request %s: its session crashed; resuming after %d tokens",
                        request.request_id, len(actor.generated))

    async def _healthy_target(self) -> SerialDecodeActor | AdmissionActor:
        """What takes requests, once the engine is healthy (waits through a restart, bounded)."""
        with trio.move_on_after(self.config.resume_timeout_s):
            while True:
                target = self._submit_target
                if target is not None and self.health()[0]:
                    return target
                await trio.sleep(0.01)
        raise EngineRestarted(f"the engine did not recover within {self.config.resume_timeout_s:.0f} s: "
                              f"{self.health()[1]}")

    async def complete(self, prompt: Prompt, **kwargs: Any) -> Completion:
        """Generate to the end and return the whole text."""
        texts: list[str] = []
        ids: list[int] = []
        async for event in self.generate(prompt, **kwargs):
            if isinstance(event, TextDelta):
                texts.append(event.text)
                ids.extend(event.token_ids)
            elif isinstance(event, Finished):
                return Completion("".join(texts), tuple(ids), event.finish_reason, event.usage)
        raise ActorCrashed("generation ended without a finish event")

    # -- actors ----------------------------------------------------------------

    async def _run_lease(self, *, task_status: trio.TaskStatus[GpuLease] = trio.TASK_STATUS_IGNORED) -> None:
        lease = GpuLease(on_thread_exit=release_thread_streams, faults=self.faults)
        async with trio.open_nursery() as nursery:
            await nursery.start(lease.serve)
            self._lease = lease
            task_status.started(lease)
            if self._model is None and self._load_error is None:
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
            self._model = await lease.run(partial(load_model, self.config.model, cache_dir=self.config.cache_dir))
            log.info("model %s loaded from %s", self._model.model_id, self._model.path)
        except Exception as exc:
            # Retrying cannot fix a missing or broken model: report it instead of restarting.
            error = exc if isinstance(exc, MlxTrioError) else ModelLoadError(f"loading the model failed: {exc!r}")
            log.error("%s", error)
            self._load_error = error
        self._model_settled.set()

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise `ModelLoadError` if it never will be."""
        await self._model_settled.wait()
        if self._load_error is not None:
            raise self._load_error

    async def _run_serial_decoder(self, *, task_status: trio.TaskStatus[SerialDecodeActor] = trio.TASK_STATUS_IGNORED) -> None:
        assert self._lease is not None  # rest_for_one: the lease started first
        decoder = SerialDecodeActor(self._lease, self._wait_model, max_queue=self.config.max_queue,
                                    prefill_step_size=self.config.prefill_step_size, faults=self.faults)
        self._decoder = decoder
        await decoder.run(task_status=task_status)

    def _release(self, request_id: str) -> None:
        if self._admission is not None:
            self._admission.release(request_id)

    async def _run_batch_decoder(self, *, task_status: trio.TaskStatus[BatchDecodeActor] = trio.TASK_STATUS_IGNORED) -> None:
        assert self._lease is not None
        decoder = BatchDecodeActor(self._lease, self._wait_model, release=self._release, max_rows=self.config.batch,
                                   faults=self.faults)
        self._decoder = decoder
        await decoder.run(task_status=task_status)

    async def _run_prefill(self, *, task_status: trio.TaskStatus[PrefillActor] = trio.TASK_STATUS_IGNORED) -> None:
        assert self._lease is not None and isinstance(self._decoder, BatchDecodeActor)
        prefill = PrefillActor(self._lease, self._wait_model, join=self._decoder.join_send, release=self._release,
                               max_rows=self.config.batch, prefill_step_size=self.config.prefill_step_size,
                               faults=self.faults)
        self._prefill = prefill
        await prefill.run(task_status=task_status)

    async def _run_admission(self, *, task_status: trio.TaskStatus[AdmissionActor] = trio.TASK_STATUS_IGNORED) -> None:
        assert isinstance(self._decoder, BatchDecodeActor) and self._prefill is not None
        decoder, prefill = self._decoder, self._prefill
        admission = AdmissionActor(
            prefill.inbox_send, get_limits=self._admission_limits, max_rows=self.config.batch,
            max_queue=self.config.max_queue, in_flight=lambda: decoder.in_flight() + prefill.in_flight(),
            faults=self.faults,
        )
        self._admission = admission
        await admission.run(task_status=task_status)

    async def _admission_limits(self) -> Limits:
        model = await self._wait_model()
        layout, step = model.kv_layout, self.config.prefill_step_size
        budget = self.config.kv_budget_bytes
        if budget is None:
            budget = default_kv_budget(model.weights_bytes)
            log.info("KV budget %.1f GiB (device memory minus weights and headroom; set --kv-budget to change)",
                     budget / 2**30)
        return Limits(
            project_bytes=lambda cmd: layout.row_bytes(len(cmd.prompt_ids) + cmd.params.max_tokens),
            transient_bytes=lambda cmd: layout.prefill_transient_bytes(
                len(cmd.prompt_ids), min(step, max(len(cmd.prompt_ids) - 1, 1))),
            budget_bytes=budget,
            # A model whose caches cannot merge runs the batch lane one row at a time.
            max_rows=self.config.batch if layout.batchable else 1,
        )

    async def _wait_model(self) -> LoadedModel:
        """The loaded model; if loading failed for good, wait forever (health reports why) instead of crash-looping."""
        await self._model_settled.wait()
        if self._model is None:
            await trio.sleep_forever()
        return self.model

    async def run(self, *, task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the supervision tree until cancelled; `started` once every actor runs (the model may still load)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self._root.run)
            task_status.started(self)


def _merge_params(defaults: SamplingParams, sampling: Mapping[str, Any]) -> SamplingParams:
    given = SamplingParams.from_kwargs(sampling)
    explicit = {k: getattr(given, k) for k in sampling if sampling[k] is not None or k == "seed"}
    return attrs.evolve(defaults, **explicit)


@asynccontextmanager
async def open_engine(model: str | None = None, *, config: EngineConfig | None = None,
                      **options: Any) -> AsyncIterator[Engine]:
    """Start an engine, wait until its model is loaded, and stop it on exit.

    `model` and `options` are `EngineConfig` fields; pass `config` instead to
    give a whole configuration.
    """
    if config is None:
        config = EngineConfig(model=model, **options)
    engine = Engine(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        try:
            await engine.wait_ready()
            yield engine
        finally:
            nursery.cancel_scope.cancel()
