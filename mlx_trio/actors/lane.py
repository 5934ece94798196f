"""The engine lane as one record: its actors and what they share.

One lane serves every `--batch` value; `--batch 1` is the same lane with a
row cap of 1, so a lone row never shares a step and its tokens do not
depend on other requests (the determinism pin). A request flows:

    session ──Generate──▶ admission ──Generate──▶ prefill ──JoinRow──▶ decode-step
       ▲                   (FIFO, row cap,         (solo or cohort       (the running batch,
       │                    KV budget)              prefill, token 0)     one step per job)
       └──────────── reply: PrefillProgressed, TokensDecoded, GenerationEnded ◀────────────┘

The actors find each other and what they share (the lease, the model, the
prompt cache, the config, the faults) here, not through closures: the
engine subtree (actors/engine_tree.py) builds one `Lane` and each
`ChildSpec` puts its actor in it, so a restarted actor replaces its own
field and every other actor sees the new one. `end_request` is the one way
a request ends, whichever actor holds it.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

from mlx_trio.actors.arrivals import Arrivals
from mlx_trio.actors.memory_budget import MemoryBudget
from mlx_trio.actors.messages import Generate, GenerationEnded
from mlx_trio.actors.row_cap import row_bound
from mlx_trio.actors.prompt_caching import AdapterCaching
from mlx_trio.engine.prompt_cache.namespace import adapter_namespace, kv_revision
from mlx_trio.config import EngineConfig, KvLayoutChoice
from mlx_trio.errors import LeaseClosed, MlxTrioError
from mlx_trio.supervision.faults import Faults

if TYPE_CHECKING:
    from mlx_trio.actors.admission import AdmissionActor
    from mlx_trio.actors.cache_persistence import CachePersistenceActor
    from mlx_trio.actors.decode_step import DecodeStepActor
    from mlx_trio.actors.gpu_lease import GpuLease
    from mlx_trio.actors.prefill import PrefillActor
    from mlx_trio.actors.prompt_caching import PromptCaching
    from mlx_trio.engine.adapters.resident import ResidentAdapters
    from mlx_trio.engine.model.load import LoadedModel


@attrs.define(eq=False)
class Lane:
    """The lane's current actors (None until started; a restart replaces one) and their shared state.

    Invariant: an actor's field is set before its `ChildSpec` reports it
    started, and rest_for_one starts the lease, decode-step, prefill and
    admission in that order, so each actor may use the ones before it.
    """

    config: EngineConfig
    faults: Faults
    # Loaded once; outlives every restart (a restarted lease reuses the evaluated weights).
    model: LoadedModel | None = None
    load_error: MlxTrioError | None = None
    # While the model loads: what start-up is doing now ("loading model: <phase>"), /health's reason.
    startup: str = "loading model"
    _model_settled: trio.Event = attrs.field(factory=trio.Event, init=False)
    lease: GpuLease | None = None
    decode_step: DecodeStepActor | None = None
    prefill: PrefillActor | None = None
    admission: AdmissionActor | None = None
    persistence: CachePersistenceActor | None = None
    # The prompt cache outlives actor restarts; created once the KV budget is known (None: off).
    caching: PromptCaching | None = None
    # The served adapters, set with the model when the config serves any (None: the base model only);
    # like the model, they outlive restarts. Used on the lease thread, but for its `names`.
    adapters: ResidentAdapters | None = None
    # Requests being prepared or prepared and not yet submitted: a wave the prefill actor may wait for.
    arrivals: Arrivals = attrs.field(factory=Arrivals, init=False)
    # The KV budget in force (actors/memory_budget.py): set once the budget is known; outlives restarts.
    memory: MemoryBudget | None = None
    # Paged KV: each admitted (or queued head) request's pinned cached prefix (`PagedKV.pin_prefix`), which
    # admission credits; its row takes it over at join, `end_request` drops it. Pins whose unpin found no lease
    # serving wait in `stale_pins` for the next admission to drop them (`drop_stale_pins`).
    pins: dict[str, Any] = attrs.field(factory=dict, init=False)
    stale_pins: list[Any] = attrs.field(factory=list, init=False)

    # --kv-layout's layout in force and why, decided at load before the model settles (`/v1/status` reports it);
    # the actors read the layout itself off `model.paged_kv` (the block pool, or None: padded).
    kv_layout: KvLayoutChoice | None = None

    # `--batch auto`: the cap chosen from the KV budget and the model (actors/row_cap.py), set before the model
    # settles, so every actor that waits for the model sees it; None under `--batch N`.
    auto_rows: int | None = None

    @property
    def row_cap(self) -> int:
        """Rows decoding together: `--batch N`, auto's choice, or 1 for a model whose caches cannot merge.

        Before the model is known under `--batch auto`: the most auto may choose (`row_bound`).
        """
        if self.model is not None and not self.model.kv_layout.batchable:
            return 1
        if self.config.batch is not None:
            return self.config.batch
        return self.auto_rows if self.auto_rows is not None else self.row_bound

    @property
    def row_bound(self) -> int:
        """The most rows this lane may ever hold, known before the model: sizes the channels between actors."""
        return row_bound(self.config.batch)

    # -- the model -----------------------------------------------------------

    def settle_model(self, model: LoadedModel | None, error: MlxTrioError | None = None) -> None:
        """Loading ended, with `model` or for good with `error`."""
        self.model, self.load_error = model, error
        self._model_settled.set()

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise `ModelLoadError` if it never will be."""
        await self._model_settled.wait()
        if self.load_error is not None:
            raise self.load_error

    async def wait_model(self) -> LoadedModel:
        """The loaded model; if loading failed for good, wait forever (health reports why) instead of crash-looping."""
        await self._model_settled.wait()
        if self.model is None:
            await trio.sleep_forever()
        assert self.model is not None
        return self.model

    def caching_for(self, request: Generate) -> PromptCaching | AdapterCaching | None:
        """The prompt cache as `request` uses it: its adapter's namespace of it, or the cache itself (None: off)."""
        if self.caching is None or request.adapter is None:
            return self.caching
        if self.adapters is None or self.adapters.known(request.adapter) is None:
            return None  # its prefill fails: the adapter is gone
        return AdapterCaching(self.caching, adapter_namespace(request.adapter, self.adapters.revision(request.adapter)))

    def kv_revision(self, adapter: str | None) -> str | None:
        """What the paged KV blocks of a row of `adapter` are keyed under ("": the base model), read off the lease
        thread (`ResidentAdapters.revisions` is replaced whole); None for a name not served now."""
        if adapter is None:
            return ""
        revision = self.adapters.revisions.get(adapter) if self.adapters is not None else None
        return kv_revision(adapter, revision) if revision is not None else None

    # -- requests --------------------------------------------------------------

    def in_flight(self) -> list[Generate]:
        """Requests admitted and not ended: prefilling, waiting to join, or decoding."""
        decoding = self.decode_step.in_flight() if self.decode_step is not None else []
        prefilling = self.prefill.in_flight() if self.prefill is not None else []
        return [*decoding, *prefilling]

    @property
    def decoding(self) -> bool:
        """Whether rows decode now (their steps stall for each prefill chunk)."""
        return self.decode_step is not None and self.decode_step.decoding

    @property
    def decoding_rows(self) -> int:
        """How many rows are in the decode batch now (0 when none)."""
        return self.decode_step.num_rows if self.decode_step is not None else 0

    def rows_kv_bytes(self) -> int:
        """KV bytes the rows hold now (`/stats` `batch.kv_bytes`): under paged KV the blocks they reference (a
        shared block once), else the decode batch's caches and those of the prompts prefilling."""
        paged = self._paged_kv()
        if paged is not None:
            blocks = paged.counters()
            return blocks["used"] * blocks["block_bytes"]
        decoding = self.decode_step.statistics().kv_bytes if self.decode_step is not None else 0
        prefilling = self.prefill.statistics().active_kv_bytes if self.prefill is not None else 0
        return decoding + prefilling

    def held_kv_bytes(self) -> int:
        """KV bytes this lane holds now: the rows' (`rows_kv_bytes`) and the prompt cache's."""
        return self.rows_kv_bytes() + (self.caching.nbytes if self.caching is not None else 0)

    def _paged_kv(self) -> Any:
        """The model's block pool under paged KV (engine/kv/blocks/), else None."""
        return self.model.paged_kv if self.model is not None else None

    def not_idle(self) -> list[str]:
        """What the lane's pools still hold, one line each (empty: idle). Read from each pool's own statistics.

        Once every request has ended (and its last leave, one decode step behind
        its `Finished`, is done) every pool is back to zero: anything listed
        then is a leak (`Engine.report_leaks`). A new pool adds one line here.
        """
        admission = self.admission.statistics() if self.admission is not None else None
        decode = self.decode_step.statistics() if self.decode_step is not None else None
        prefill = self.prefill.statistics() if self.prefill is not None else None
        lease = self.lease.statistics() if self.lease is not None else None
        resident = cast("dict[str, int]", self.adapters.statistics()["resident"]) if self.adapters is not None else {}
        held = [
            ("admission reserved bytes", admission.reserved_bytes if admission else 0),
            ("admission rows in flight", admission.in_flight_rows if admission else 0),
            ("admission queue", admission.mailbox_depth if admission else 0),
            ("requests in the lane", ", ".join(cmd.request_id for cmd in self.in_flight())),
            ("prefill inbox", prefill.mailbox_depth if prefill else 0),
            ("decode joins waiting", decode.mailbox_depth if decode else 0),
            ("decode batch rows", decode.active_rows if decode else 0),
            ("decode batch KV bytes", decode.kv_bytes if decode else 0),
            ("prefill jobs", prefill.prefilling if prefill else 0),
            ("prefill KV bytes", prefill.active_kv_bytes if prefill else 0),
            ("adapter slots held", ", ".join(f"{name} x{holds}" for name, holds in resident.items() if holds)),
            ("prompt-cache puts pending", self.caching.cache.pending if self.caching is not None else 0),
            # Paged KV: blocks rows reference (cached blocks no row holds are the prompt cache, not a leak).
            ("prefix pins held", len(self.pins) + len(self.stale_pins)),
            ("paged KV blocks in use", paged.counters()["used"] if (paged := self._paged_kv()) is not None else 0),
            ("arrivals never reached", self.arrivals.expected()),
            ("GPU lease jobs queued", lease.queue_depth if lease else 0),
            ("GPU lease job running", lease.running_since is not None if lease else False),
        ]
        return [f"{name}: {amount}" for name, amount in held if amount]

    def end_request(self, request: Generate, ended: GenerationEnded | None = None, *,
                    row: object | None = None) -> None:
        """The one way a request ends, whichever actor holds it; idempotent, never raises, never waits.

        Sends `ended` if given and the session still listens (without it, the
        closed reply tells the session the lane failed under it: it resumes),
        closes the reply channel (its only closer), releases the request's
        admission reservation, settles its pending prompt-cache put (made by
        now, if it ever will be), and frees `row` (a `SoloRow` not in the
        batch) on the lease thread, which owns its arrays.
        """
        if ended is not None:
            try:
                request.reply.send_nowait(ended)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                pass  # the session left (or cannot take more): it needs no last word
        request.reply.close()
        if self.admission is not None:
            self.admission.release(request.request_id)
        if self.caching is not None:
            self.caching.settle_put(request.request_id)
        if row is not None and self.lease is not None:
            self.lease.free_nowait(row.close)  # type: ignore[attr-defined]
        pin = self.pins.pop(request.request_id, None)
        if pin is not None:
            self.unpin(pin)

    def unpin(self, pin: Any) -> None:
        """Drop a prefix pin on the lease thread (a no-op once its row took it over), never waits. With no lease
        serving (it crashed) the pin waits in `stale_pins`: the pool outlives the lease, its references must not."""
        paged = self._paged_kv()
        try:
            if self.lease is None:
                raise LeaseClosed("no lease")
            self.lease.submit_nowait(partial(paged.unpin, pin))
        except LeaseClosed:
            self.stale_pins.append(pin)

    async def drop_stale_pins(self) -> None:
        """Drop (one lease job) the pins no request holds: those whose unpin found no lease serving, and those
        of requests no longer in flight. Admission calls it as it starts, before it pins anything."""
        flying = {cmd.request_id for cmd in self.in_flight()}
        for rid in [rid for rid in self.pins if rid not in flying]:
            self.stale_pins.append(self.pins.pop(rid))
        stale, self.stale_pins = self.stale_pins, []
        paged = self._paged_kv()
        if stale and paged is not None and self.lease is not None:
            try:
                await self.lease.run(lambda: [paged.unpin(pin) for pin in stale])
            except BaseException:
                self.stale_pins.extend(stale)
                raise
