"""Run workloads: one run is one workload against one server at one concurrency.

`run_matrix` alternates the servers inside every round (A B A B ...), so a
noisy neighbour or a warming machine hits each stack alike, and gives each
(concurrency, round) its own seed, so no run finds another run's prompts in a
prefix cache; both servers of a round get the identical workload.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import attrs
import httpx
import trio

from mlx_trio.bench import gpu_busy, workloads
from mlx_trio.bench.client import RequestResult, RequestSpec, messages, stream_chat
from mlx_trio.bench.progress import ProgressFactory, no_progress

log = logging.getLogger("mlx_trio.bench")

# Connect quickly or fail; reads wait long, because a big prefill on a slow box
# can go quiet (mlx_lm.server sends keepalives, but only per prefill chunk).
CONNECT_TIMEOUT_S = 30.0
WARMUP_MAX_TOKENS = 4


class Server(Protocol):
    """What the runner needs of a server: a name, a base URL, and a way to make sure it is up."""

    name: str

    @property
    def url(self) -> str: ...

    async def ensure_up(self) -> None: ...

    def exited(self) -> bool: ...


@attrs.frozen
class RunOptions:
    """Per-request settings shared by every run."""

    logit_bias: Mapping[int, float] = attrs.field(factory=dict)
    request_model: str | None = None  # sent as `model`; None omits it (mlx_lm.server then uses its --model)
    read_timeout_s: float = 600.0
    api_key: str | None = None
    # Tests put an httpx.MockTransport here; None is the network.
    transport: httpx.AsyncBaseTransport | None = None


@attrs.frozen
class RunRecord:
    """The results of one run (one server, one concurrency, one round)."""

    server: str
    concurrency: int
    round: int
    results: tuple[RequestResult, ...]
    server_died: bool = False
    # The GPU's mean busy percentage during the run (`gpu_busy`), None where nvidia-smi is absent.
    gpu_busy_percent: float | None = None
    # The workload's arrival rate (sessions per second; None: all at once), where a run sweeps rates (`--rates`).
    rate_per_s: float | None = None


def run_seed(seed: int, concurrency_index: int, round_index: int) -> int:
    """The workload seed of one (concurrency, round): distinct per run, identical for every server."""
    return seed * 1_000_000 + concurrency_index * 1_000 + round_index


def _client(max_in_flight: int, options: RunOptions) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    timeout = httpx.Timeout(options.read_timeout_s, connect=CONNECT_TIMEOUT_S, pool=None)
    limits = httpx.Limits(max_connections=max_in_flight + 1, max_keepalive_connections=max_in_flight + 1)
    return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers, transport=options.transport)


async def run_workload(url: str, workload: workloads.Workload, options: RunOptions, *,
                       on_result: Callable[[RequestResult], None] = lambda _: None) -> list[RequestResult]:
    """Run every session of `workload` against the server at `url`; one result per request.

    At most `workload.max_in_flight` sessions run at once; a session holds its
    slot across its turns (an agent keeps working). A failed turn fails the
    session's later turns without sending them.
    """
    results: list[RequestResult] = []
    limiter = trio.CapacityLimiter(workload.max_in_flight)
    # Streams that have had their first token or ended without one (long-prompt waits on these).
    settled = _Counter()

    def record(result: RequestResult) -> None:
        results.append(result)
        on_result(result)

    async with _client(workload.max_in_flight, options) as client:
        start_s = time.perf_counter()

        async def run_session(session: workloads.Session) -> None:
            if session.after_first_tokens:
                await settled.wait_for(session.after_first_tokens)
            else:
                await trio.sleep(max(0.0, start_s + session.arrival_s - time.perf_counter()))
            async with limiter:
                history: list[tuple[str, str]] = []
                for turn_index, turn in enumerate(session.turns):
                    spec = RequestSpec(messages(session.system, history, turn.user), turn.max_tokens,
                                       model=options.request_model,
                                       logit_bias={**options.logit_bias, **turn.logit_bias}, sampling=turn.sampling)
                    first = _Once(settled.increment)
                    result = await stream_chat(client, url, spec, session_id=session.session_id,
                                               turn=turn_index, tag=session.tag, on_first_token=first)
                    first()  # a stream that ended without a token is settled too
                    record(result)
                    if not result.ok:
                        for later in range(turn_index + 1, len(session.turns)):
                            record(RequestResult(session_id=session.session_id, turn=later, tag=session.tag,
                                                 ok=False, start_s=result.end_s, end_s=result.end_s,
                                                 error="an earlier turn of the session failed"))
                        return
                    history.append((turn.user, result.text))

        async with trio.open_nursery() as nursery:
            for session in workload.sessions:
                nursery.start_soon(run_session, session)
    return results


async def warmup(url: str, options: RunOptions) -> RequestResult:
    """One short request, so model loading and first-call compilation fall outside the measurements."""
    async with _client(1, options) as client:
        spec = RequestSpec(messages(None, [], "Say hello."), WARMUP_MAX_TOKENS, model=options.request_model,
                           logit_bias=options.logit_bias)
        return await stream_chat(client, url, spec, session_id="warmup", tag="warmup")


async def run_matrix(servers: Sequence[Server], workload_name: str, params: workloads.WorkloadParams,
                     concurrencies: Sequence[int], rounds: int, options: RunOptions, *,
                     requests_per_stream: int = 0, progress: ProgressFactory = no_progress,
                     records: list[RunRecord] | None = None) -> list[RunRecord]:
    """For each concurrency, `rounds` rounds, each running every server in order: A B A B.

    `requests_per_stream` > 0 raises a run's request count to that many per
    concurrent stream. A managed server that died is restarted before its next
    run, and the run during which it died is marked `server_died`. Each
    finished run is appended to `records` (a new list if None) as it ends, so
    a caller that is cancelled keeps the runs that finished.
    """
    records = [] if records is None else records
    for ci, concurrency in enumerate(concurrencies):
        num_requests = max(params.num_requests, requests_per_stream * concurrency)
        for round_index in range(rounds):
            run_params = attrs.evolve(params, num_requests=num_requests, seed=run_seed(params.seed, ci, round_index))
            workload = workloads.build(workload_name, run_params, concurrency)
            for server in servers:
                records.append(await _one_run(server, workload, concurrency, round_index, rounds, options, progress))
    return records


async def _one_run(server: Server, workload: workloads.Workload, concurrency: int, round_index: int, rounds: int,
                   options: RunOptions, progress: ProgressFactory) -> RunRecord:
    label = f"{server.name} c={concurrency} round {round_index + 1}/{rounds}"
    try:
        await server.ensure_up()
    except Exception as exc:  # noqa: BLE001  (a server that cannot restart fails this run's requests, not the bench)
        log.warning("%s: server is down and could not be restarted: %s", label, exc)
        now = time.perf_counter()
        failed = tuple(RequestResult(session_id=s.session_id, turn=t, tag=s.tag, ok=False, start_s=now, end_s=now,
                                     error=f"server down: {exc}"[:200])
                       for s in workload.sessions for t in range(len(s.turns)))
        return RunRecord(server.name, concurrency, round_index, failed, server_died=True)
    busy: list[float] = []
    with progress(label, workload.num_requests) as bar:
        async with trio.open_nursery() as nursery:
            if gpu_busy.available():
                nursery.start_soon(gpu_busy.sample, busy)
            results = await run_workload(server.url, workload, options, on_result=lambda r: bar.advance(r.ok))
            nursery.cancel_scope.cancel()
    died = server.exited()
    if died:
        log.warning("%s: the server process exited during the run", label)
    return RunRecord(server.name, concurrency, round_index, tuple(results), server_died=died,
                     gpu_busy_percent=gpu_busy.mean(busy))


class _Counter:
    """A count that tasks can wait on reaching a value."""

    def __init__(self) -> None:
        self.value = 0
        self._changed = trio.Event()

    def increment(self) -> None:
        self.value += 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, target: int) -> None:
        while self.value < target:
            await self._changed.wait()


class _Once:
    """Calls `fn` on the first call only."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()
