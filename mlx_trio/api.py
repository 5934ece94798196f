"""The embeddable API: `async with open_engine(...) as engine`.

The engine is a supervision tree of Trio actors:

    root (one_for_one, never gives up)
    ├── engine (rest_for_one)      gpu-lease and the lane's actors (actors/engine_tree.py); when it
    │                              gives up it is down (503s) and starts again after a backoff
    ├── sessions (one_for_one)     one temporary session actor per request
    └── (extra children)           e.g. the HTTP server of `mlx-trio serve`

`Engine.generate` validates and tokenizes for the caller, in a worker thread
(so bad input raises there and never reaches an actor), starts a session,
and yields its events. `Engine.stream` is the one resume loop: it outlives
every session of a request, so it alone can carry on when the lane fails
under a session or the session itself crashes (a crashed actor cannot
restart itself with its state).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from functools import partial
from typing import Any

import attrs
import trio

from mlx_trio.actors.engine_tree import EngineActors
from mlx_trio.actors.gpu_lease import GpuLease
from mlx_trio.actors.prefill import SNAPSHOT_MIN_TOKENS
from mlx_trio.actors.messages import Generate, Request
from mlx_trio.actors.session import SessionActor, SessionOutput
from mlx_trio.config import EngineConfig
from mlx_trio.engine.adapters.resident import ResidentAdapters
from mlx_trio.engine.model.chat import content_text
from mlx_trio.engine.model.load import LoadedModel
from mlx_trio.errors import (ActorCrashed, AdapterError, ContextTooLong, EngineDown, EngineFailure, EngineRestarted,
                             InvalidParameter, MlxTrioError, ModelNotFound)
from mlx_trio.events import Completion, Finished, GenerationEvent, TextDelta
from mlx_trio.output_format import OutputFormat
from mlx_trio.logprobs import TokenLogprob
from mlx_trio.params import SamplingParams
from mlx_trio.profiling import request_phase
from mlx_trio.supervision import Backoff, ChildSpec, Restart, Strategy, Supervisor
from mlx_trio.supervision.faults import Faults

log = logging.getLogger("mlx_trio.engine")
# Resources an engine still held when it was closed with every request ended (`Engine.report_leaks`).
leaks_log = logging.getLogger("mlx_trio.leaks")

# Attempts in a row that bring no new token and fail for a cause of the request's own (its session
# crashed, or its own prefill failed) before it fails with EngineRestarted. Progress resets the count.
# Attempts that the lane failed under (an engine actor crashed under every request it held) never
# count: those are not the request's fault, however often they come (docs/supervision.md, "The
# resume rule"); they are bounded by time instead, `EngineConfig.resume_timeout_s` without a new token.
MAX_RESUMES = 3
# A resume waits 10 ms, doubled after each attempt in a row that brought no token, up to this.
MAX_RESUME_DELAY_S = 1.0
# The root never gives up: the engine subtree retries itself (`Retrying`), and the sessions
# supervisor and the HTTP child restart as often as they fail, a crash loop slowed to at most
# one restart a second. Only SIGTERM or a model that cannot load ends the process.
ROOT_MAX_RESTARTS = 1_000_000
ROOT_BACKOFF = Backoff(first_s=0.05, max_s=1.0, quick_s=2.0)

Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]
# A prompt of at most this many characters (or token ids), with no tools and no grammar, is prepared on the
# Trio thread itself: rendering and tokenizing it is a fraction of a millisecond (~0.5 ms at 1024 characters
# on this box's CPU), less than a worker thread's hand-off costs. Prepared in worker threads, a burst of 64
# short chats took 23-27 ms to the last, inline 10 (the GIL serialises them either way;
# docs/lab-notes/2026-12-04-h200-pass19.md).
INLINE_PREPARE_MAX_CHARS = 1024
# How long a closing engine waits for its pools to go idle: a request's last leave (and its prompt-cache put)
# comes one decode step after its `Finished`, and a cancelled one is freed at its next chunk or step.
IDLE_SETTLE_S = 1.0
# The name every client may use for the base model (as the HTTP API's "default").
DEFAULT_MODEL_NAME = "default"


class Engine:
    """A running engine. Create it with `open_engine`; all methods are Trio-side."""

    def __init__(self, config: EngineConfig, *, extra_children: Sequence[ChildSpec] = ()) -> None:
        self.config = config
        # Armed by tests and by POST /v1/admin/faults; actors check it at each message or step.
        self.faults = Faults()
        self.actors = EngineActors(config, self.faults)
        self._request_ids = itertools.count(1)
        self._streams = 0  # `stream` calls not ended yet: requests in flight, as their callers see them
        # Adapters being unloaded: requests may no longer name them.
        self._unloading: set[str] = set()
        # Sessions are temporary: a crashed session fails its own request only.
        self._sessions = Supervisor("sessions", strategy=Strategy.ONE_FOR_ONE, max_restarts=1_000_000, period_s=1.0)
        # `extra_children` (the HTTP server) start after the engine, so they can
        # serve /health while the model loads, and stop first on shutdown.
        self._root = Supervisor(
            "root",
            [self.actors.retrying.as_child(), self._sessions.as_child(), *extra_children],
            strategy=Strategy.ONE_FOR_ONE,
            max_restarts=ROOT_MAX_RESTARTS,
            period_s=1.0,
            backoff=ROOT_BACKOFF,
        )

    # -- facts ---------------------------------------------------------------

    @property
    def model(self) -> LoadedModel:
        if self.actors.model is None:
            raise EngineFailure("the model is not loaded yet")
        return self.actors.model

    @property
    def model_id(self) -> str:
        return self.model.model_id

    @property
    def context_length(self) -> int | None:
        """Prompt plus answer tokens the model takes (None: its config does not say; no limit is enforced)."""
        return self.model.context_length

    @property
    def output_format(self) -> OutputFormat:
        """How the model marks reasoning and tool calls (mlx-lm's markers and parsers, pure Python)."""
        return self.model.output_format

    def health(self) -> tuple[bool, str]:
        """(ok, reason): ok only when the model is loaded and every engine actor runs."""
        return self.actors.health()

    @property
    def group_lost(self) -> str | None:
        """Scale-out only: why rank 0 lost its group (for good in this process), else None (docs/scale-out.md)."""
        return self.actors.group_lost

    def status(self) -> dict[str, Any]:
        """The live supervision tree plus engine counters, as plain data."""
        model = self.actors.model
        status = {"tree": self._root.status(), "model": model.model_id if model else None,
                  "counters": self.actors.counters(), "prompt_cache": self.actors.prompt_cache_counters(),
                  # The KV budget as memory allows it now (actors/memory_budget.py); None until the model is known.
                  "memory": memory.report() if (memory := self.actors.lane.memory) is not None else None,
                  # Scale-out: each rank (id, host, backend, state, last heartbeat); [] in one process.
                  "ranks": self.actors.ranks.status() if self.actors.ranks is not None else []}
        adapters = self.actors.lane.adapters
        if adapters is not None:  # only on an engine that serves adapters
            status["adapters"] = adapters.statistics()
        return status

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise `ModelLoadError` if it never will be."""
        await self.actors.wait_ready()

    def not_idle(self) -> list[str]:
        """What the engine holds now, one line per pool (empty: idle): the lane's pools and live sessions."""
        sessions = len(self._sessions.status()["children"])
        return [*self.actors.lane.not_idle(), *([f"sessions running: {sessions}"] if sessions else [])]

    async def report_leaks(self) -> list[str]:
        """At shutdown: what the engine still holds with every request ended, each logged at ERROR on
        the leak log (`mlx_trio.api.leaks_log`) (docs/design.md §7).

        Waits up to `IDLE_SETTLE_S` for the pools to go idle first. An engine
        closed mid-stream (a `stream` not ended) is not judged: returns [].
        """
        if self._streams:
            return []
        with trio.move_on_after(IDLE_SETTLE_S):
            while self.not_idle():
                await trio.sleep(0.01)
        leaks = [] if self._streams else self.not_idle()
        for leak in leaks:
            leaks_log.error("engine closed with every request ended, yet it holds %s", leak)
        return leaks

    async def drain_persistence(self) -> None:
        """Wait until the prompt cache's SSD tier has written what it was offered (graceful shutdown)."""
        await self.actors.drain_persistence()

    # -- requests -------------------------------------------------------------

    def prepare(self, prompt: Prompt, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None, clamp_max_tokens: bool = True,
                model: str | None = None, **sampling: Any) -> Request:
        """Validate and tokenize; raises `InvalidParameter` / `ContextTooLong` naming the field.

        `model` picks an adapter by its name (`lora_modules`); None, the base
        model's id or "default" is the base model. On an engine that serves
        adapters any other name is `ModelNotFound`; on one that serves none,
        every name is the base model (clients send names of their own).

        `tools` (OpenAI function tools) go to the chat template, or, where it
        has no tool format, into the chat in the generic one. Chat roles, message
        contents and template arguments are checked once, by `LoadedModel.encode`
        (`engine/model/chat.py`), whoever the caller.

        Context policy: a prompt that leaves no room for one new token is
        `ContextTooLong` ("prompt is too long: N tokens > M maximum", the
        words harnesses read to compact). A `max_tokens` over the room left is
        lowered to that room (the answer then ends with "length" when it fills
        the context), or, with `clamp_max_tokens=False`, `ContextTooLong`.
        """
        adapter = self._adapter_named(model)
        params = _merge_params(self.config.defaults, sampling).validate(vocab_size=self.model.vocab_size)
        if params.constraint is not None:
            self.model.check_constraint(params.constraint)
        ids = self._encode(prompt, chat_template_kwargs=chat_template_kwargs, tools=tools)
        limit = self.model.context_length
        if limit is not None and len(ids) + params.max_tokens > limit:
            field = "prompt" if isinstance(prompt, str) or isinstance(prompt[0], int) else "messages"
            if len(ids) >= limit:
                raise ContextTooLong(f"prompt is too long: {len(ids)} tokens > {limit - 1} maximum "
                                     f"(the model's context is {limit} tokens); shorten the prompt", field=field)
            if not clamp_max_tokens:
                raise ContextTooLong(f"input length and `max_tokens` exceed context limit: {len(ids)} + "
                                     f"{params.max_tokens} > {limit}, decrease input length or `max_tokens` "
                                     "and try again", field=field)
            params = attrs.evolve(params, max_tokens=limit - len(ids))
        boundary = None
        if len(ids) >= SNAPSHOT_MIN_TOKENS:  # shorter prompts never store a snapshot
            boundary = self.model.message_boundary(prompt, ids, chat_template_kwargs=chat_template_kwargs,
                                                   tools=tools)
        return Request(f"req-{next(self._request_ids)}", tuple(ids), params, snapshot_at=boundary, adapter=adapter)

    # -- adapters ---------------------------------------------------------------

    def served_adapters(self) -> tuple[str, ...]:
        """The adapters a request may name, in load order (empty when none are served)."""
        adapters = self.actors.lane.adapters
        return adapters.names if adapters is not None else ()

    def served_models(self) -> tuple[str, ...]:
        """The base model's id, then every served adapter's name."""
        return (self.model_id, *self.served_adapters())

    def _adapter_named(self, model: str | None) -> str | None:
        """The adapter a request's `model` names; None for the base model. Raises `ModelNotFound`."""
        adapters = self.actors.lane.adapters
        if model is None or adapters is None or model in (self.model_id, DEFAULT_MODEL_NAME):
            return None
        if model in adapters.names and model not in self._unloading:
            return model
        raise ModelNotFound(model, self.served_models())

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name` from now on (a lease job); raises `AdapterError`.

        Only on an engine that serves adapters (`lora_modules` or `enable_lora_admin`).
        A name any request names (queued or in flight) must be unloaded first, or its requests waited for.
        """
        adapters = self._adapters()
        if name in (self.model_id, DEFAULT_MODEL_NAME):
            raise AdapterError(f"{name!r} is the base model's name")
        # Under paged KV admission pins a request's cached prefix under its adapter's revision, and its row joins
        # later, reading the revision again: both must read the same one. With no request naming `name` now, the
        # load job below is queued before this returns to Trio (no checkpoint between), and lease jobs run in
        # order, so any request naming it later is pinned (and joins) after the new revision is registered.
        if adapters.in_use(name) or any(cmd.adapter == name for cmd in self._requests()) or self._pinned(name):
            raise AdapterError(f"adapter {name!r} is named by queued or running requests: unload it first "
                               "(that waits for them), or wait for them to end, then load it again")
        await self._lease().run(adapters.load, name, path)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name`: new requests naming it get `ModelNotFound` at once; returns once every
        request using it has ended and its slot is freed. Raises `ModelNotFound` if it is not served."""
        adapters = self._adapters()
        if name not in adapters.names:
            raise ModelNotFound(name, self.served_models())
        self._unloading.add(name)
        try:
            while adapters.in_use(name) or any(cmd.adapter == name for cmd in self._requests()):
                await trio.sleep(0.01)
            await self._lease().run(adapters.unregister, name)
        finally:
            self._unloading.discard(name)

    def _pinned(self, name: str) -> bool:
        """Whether a prefix pin (`Lane.pins`) holds blocks under `name`'s revision: its request may sit between
        admission and the prefill actor (in its inbox, which no list of requests shows)."""
        lane = self.actors.lane
        paged = lane.model.paged_kv if lane.model is not None else None
        revision = lane.kv_revision(name)
        if paged is None or revision is None:
            return False
        root = paged.peek_root(revision)
        return any(pin.root == root for pin in list(lane.pins.values()))

    def _requests(self) -> list[Generate]:
        """Every request the lane holds: queued in admission, prefilling, waiting to join, or decoding."""
        lane = self.actors.lane
        return [*(lane.admission.queued() if lane.admission is not None else []), *lane.in_flight()]

    def _adapters(self) -> ResidentAdapters:
        adapters = self.actors.lane.adapters
        if adapters is None:
            raise EngineFailure("this engine serves no adapters (start it with lora_modules or enable_lora_admin)")
        return adapters

    def _lease(self) -> GpuLease:
        lease = self.actors.lane.lease
        if lease is None:
            raise EngineFailure("the engine is restarting")
        return lease

    def count_tokens(self, prompt: Prompt, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                     tools: Sequence[Mapping[str, Any]] | None = None, **_sampling: Any) -> int:
        """How many tokens `prepare` would prefill for the same arguments (sampling ones are ignored)."""
        return len(self._encode(prompt, chat_template_kwargs=chat_template_kwargs, tools=tools))

    def _encode(self, prompt: Prompt, *, chat_template_kwargs: Mapping[str, Any] | None,
                tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
        """The prompt's token ids, as `prepare` and `count_tokens` both render it."""
        ids = self.model.encode(prompt, chat_template_kwargs=chat_template_kwargs, tools=tools)
        if not ids:
            raise InvalidParameter("prompt", "tokenizes to no tokens")
        return ids

    async def prepare_off_loop(self, prompt: Prompt, **kwargs: Any) -> Request:
        """`prepare` in a worker thread (no MLX work: tokenizer, chat template, grammar compilation), or for a
        short prompt without tools or a grammar on the Trio thread (`prepares_inline`).

        Rendering a chat template and tokenizing a long prompt take up to tens
        of milliseconds, which on the event loop would stall every running stream.
        """
        arrivals = self.actors.lane.arrivals  # a wave the prefill actor may wait for (actors/arrivals.py)
        with arrivals.preparing():
            if prepares_inline(prompt, kwargs):
                await trio.lowlevel.checkpoint()
                request = self.prepare(prompt, **kwargs)
            else:
                request = await trio.to_thread.run_sync(partial(self.prepare, prompt, **kwargs))
        arrivals.prepared(request.request_id)
        return request

    async def generate(self, prompt: Prompt, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                       tools: Sequence[Mapping[str, Any]] | None = None,
                       **sampling: Any) -> AsyncGenerator[GenerationEvent, None]:
        """Stream a generation: `PromptProgress`*, `TextDelta`*, then one `Finished`.

        Sampling keywords are `SamplingParams` fields. Leaving the loop early
        cancels the request and frees its KV cache.
        """
        request = await self.prepare_off_loop(prompt, chat_template_kwargs=chat_template_kwargs, tools=tools,
                                              **sampling)
        async with aclosing(self.stream(request)) as events:  # leaving early ends the request now, not at GC
            async for event in events:
                yield event

    async def stream(self, request: Request, *,
                     replay: Sequence[Sequence[int]] = ()) -> AsyncGenerator[GenerationEvent, None]:
        """Run an already prepared request (see `prepare`); the one resume loop.

        `replay`: tokens an earlier process generated for this request, as the chunks its client got
        them in (a front process resumes it after the engine was lost: link/remote_engine.py). They come first, one
        `TextDelta` per chunk, as they came then, and the generation carries on after them.

        Each attempt is one session actor. If it ends without `Finished`
        (the lane failed under it, or it crashed itself), a new one carries
        on from the tokens the old one had received, so the caller still
        sees one uninterrupted stream. `EngineRestarted` only after more than
        `MAX_RESUMES` attempts in a row that brought no new token and failed for
        a cause of the request's own (its session crashed, its prefill failed),
        or after `resume_timeout_s` without a new token while the lane kept
        failing under it; a fault in any other actor is resumed from however
        often it comes.
        """
        down = self.actors.retrying.down
        if down is not None:  # the engine gave up: refuse at once rather than wait out resume_timeout_s
            raise EngineDown(f"the engine is down after too many restarts ({down.reason}); it starts again in "
                             f"{down.retry_in_s():.0f} s", retry_after_s=down.retry_in_s())
        self._streams += 1
        in_flight = True
        try:
            # aclosing: a caller that leaves early ends the attempt (and its session) now, not at garbage collection.
            async with aclosing(self._attempts(request, replay)) as attempts:
                async for event in attempts:
                    if isinstance(event, Finished):  # over for its caller, who need not ask for more
                        self._streams, in_flight = self._streams - 1, False
                    yield event
        finally:
            if in_flight:
                self._streams -= 1

    async def _attempts(self, request: Request,
                        replay: Sequence[Sequence[int]]) -> AsyncGenerator[GenerationEvent, None]:
        """`stream`'s body: one session per attempt, until `Finished` or too many fruitless resumes."""
        actor: SessionActor | None = None
        stalled = 0  # failed attempts since the last that brought a token (that one included), whatever failed
        own = 0  # of those, attempts that failed for a cause of the request's own
        progressed_at = trio.current_time()  # the request's start, or its last attempt that brought a token
        first_text = True  # until the stream's first text (the profile's request timeline)
        while True:
            send, recv = trio.open_memory_channel[SessionOutput](0)  # rendezvous: the session waits for us
            # A resume waits a moment for the restarting actors; longer after each fruitless try.
            actor = SessionActor(request, get_target=self._healthy_target, model=self.model, out=send,
                                 faults=self.faults, resume_from=actor,
                                 delay_s=min(0.01 * 2**stalled, MAX_RESUME_DELAY_S) if stalled else 0.0,
                                 replay=replay if actor is None else ())
            try:
                await self._sessions.start_child(
                    # A resumed session gets its own id: the crashed one may not be reaped yet.
                    ChildSpec(f"session-{request.request_id}" + (f".{actor.resumes}" if actor.resumes else ""),
                              actor.run, restart=Restart.TEMPORARY, kind="session")
                )
            except RuntimeError as exc:  # the sessions supervisor is not running: the tree is stopped
                raise EngineFailure("the engine is not running") from exc
            async with recv:
                try:
                    async for item in recv:
                        if isinstance(item, MlxTrioError):
                            raise item
                        if first_text and isinstance(item, TextDelta) and item.text:
                            first_text = False
                            request_phase(request.request_id, "first_text")  # under MLX_TRIO_PROFILE only
                        if isinstance(item, Finished):
                            divergence = self.actors.cache_divergence(request.prompt_ids)
                            yield attrs.evolve(item, cache_divergence=divergence) if divergence else item
                            return
                        yield item
                finally:
                    # The caller left (or the request ended): the session stops now, so the lane
                    # frees the request at its next chunk or step.
                    actor.cancel()
            if len(actor.generated) > actor.generated_at_start:
                stalled, own, progressed_at = 0, 0, trio.current_time()
            else:
                # A session that crashed (no failure of the lane's) is the request's own, as is its own prefill's.
                own += actor.failure is None or actor.own_failure
            # This failure too: a resume waits 20 ms at least, for the restarting actors.
            stalled += 1
            cause = actor.failure or ActorCrashed("its session crashed")
            if own > MAX_RESUMES:
                raise EngineRestarted(f"request {request.request_id} failed {own} times in a row without progress, "
                                      f"each time on its own; last: {cause!r}") from cause
            if trio.current_time() - progressed_at > self.config.resume_timeout_s:
                raise EngineRestarted(f"request {request.request_id}: the engine failed under it {stalled} times in "
                                      f"{self.config.resume_timeout_s:.0f} s without a new token; last: {cause!r}"
                                      ) from cause
            log.warning("request %s: %r; resuming after %d tokens", request.request_id, cause, len(actor.generated))

    async def _healthy_target(self) -> object:
        """What takes requests, once the engine is healthy (waits through a restart, bounded)."""
        with trio.move_on_after(self.config.resume_timeout_s):
            while True:
                target = self.actors.submit_target
                if target is not None and self.health()[0]:
                    return target
                if self.actors.group_lost is not None:  # no restart here brings it back: fail now, retryable
                    raise EngineDown(f"scale-out group lost: {self.actors.group_lost}")
                await trio.sleep(0.01)
        raise EngineRestarted(f"the engine did not recover within {self.config.resume_timeout_s:.0f} s: "
                              f"{self.health()[1]}")

    async def complete(self, prompt: Prompt, **kwargs: Any) -> Completion:
        """Generate to the end and return the whole text."""
        texts: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        async with aclosing(self.generate(prompt, **kwargs)) as events:  # ends its session on return, not at GC
            async for event in events:
                if isinstance(event, TextDelta):
                    texts.append(event.text)
                    ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs)
                elif isinstance(event, Finished):
                    return Completion("".join(texts), tuple(ids), event.finish_reason, event.usage, tuple(logprobs))
        raise ActorCrashed("generation ended without a finish event")

    # -- actors ----------------------------------------------------------------

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
            await engine.report_leaks()  # closed normally: judged, unless a request is still in flight
        finally:
            nursery.cancel_scope.cancel()


def prepares_inline(prompt: Prompt, kwargs: Mapping[str, Any]) -> bool:
    """Whether `prepare_off_loop` prepares `prompt` on the Trio thread: no tools, no grammar, and at most
    `INLINE_PREPARE_MAX_CHARS` characters of text (or token ids) in all; anything it cannot size cheaply is not."""
    if kwargs.get("tools") or kwargs.get("constraint") is not None:
        return False
    if isinstance(prompt, str):
        return len(prompt) <= INLINE_PREPARE_MAX_CHARS
    if not isinstance(prompt, Sequence):
        return False  # not a prompt: `prepare` says so, from a worker thread like any other
    size = 0
    for i, item in enumerate(prompt):
        if isinstance(item, Mapping):
            if any(key not in _SIZED_MESSAGE_KEYS for key in item):
                return False  # tool calls and the like: the template renders more than the content
            try:
                size += len(content_text(item.get("content"), i))
            except InvalidParameter:
                return False  # `prepare` names the field, from a worker thread like any other
        elif isinstance(item, int):
            size += 1
        else:
            return False
        if size > INLINE_PREPARE_MAX_CHARS:
            return False
    return True


# The message keys whose rendering `prepares_inline` sizes (by the content's text).
_SIZED_MESSAGE_KEYS = frozenset({"role", "content", "name"})
