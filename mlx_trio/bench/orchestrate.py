"""What `mlx-trio bench` does once its flags are parsed: start, warm up, measure, report, stop.

Every exit path stops the servers it started, by pid: the end of the bench,
a server that could not start, Ctrl-C, and SIGTERM (from `timeout` or a job
runner), which is taken as a Trio signal so that cancellation unwinds cleanly.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from mlx_trio.bench import long_context, metrics, report, workloads
from mlx_trio.bench.cli import workload_params
from mlx_trio.bench.meta import run_metadata
from mlx_trio.bench.model_info import eos_logit_bias, eos_token_ids
from mlx_trio.bench.progress import choose
from mlx_trio.bench.runner import RunOptions, RunRecord, run_matrix, warmup
from mlx_trio.bench.servers import STACK_ENV, ManagedServer, ServerStartError, UrlServer, default_model_path

log = logging.getLogger("mlx_trio.bench")


def main(args: argparse.Namespace) -> int:
    """Run the bench described by parsed `args` (targets already checked); print the table; return the exit status."""
    model = args.model
    if model is None and any(kind == "serve" for kind, _ in args.targets):
        try:
            model = default_model_path(args.python)
        except (ServerStartError, OSError, subprocess.SubprocessError) as exc:
            print(f"mlx-trio bench: {exc}", file=sys.stderr)
            return 1
    eos_ids = _eos_ids(args, model)
    log_dir = args.log_dir or Path(tempfile.gettempdir())
    if any(kind == "serve" for kind, _ in args.targets):
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="mlx-trio-bench-"))
        log_dir.mkdir(parents=True, exist_ok=True)
    servers = _servers(args, model, log_dir)
    params = workload_params(args)
    options = RunOptions(logit_bias=eos_logit_bias(eos_ids), request_model=args.request_model,
                         read_timeout_s=args.timeout_s, api_key=args.api_key)
    # Filled run by run, so that an interrupted bench still reports the runs it finished.
    records: list[RunRecord] = []
    interrupted = False
    try:
        interrupted = not trio.run(_bench, args, servers, params, options, records)
    except ServerStartError as exc:
        print(f"mlx-trio bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        interrupted = True
    finally:
        # Every exit path stops what we started, by pid.
        for server in servers:
            server.stop()
    if interrupted:
        print(f"mlx-trio bench: interrupted after {len(records)} complete run(s)", file=sys.stderr)
        if not records:
            return 130
    meta = run_metadata(args, model=model, eos_ids=eos_ids, params=attrs.asdict(params),
                        servers=[_describe(s) for s in servers], log_dir=str(log_dir))
    meta["interrupted"] = interrupted
    _report(args, records, meta)
    if any(isinstance(s, ManagedServer) for s in servers):
        print(f"server logs: {log_dir}")
    return 130 if interrupted else 0


def main_from_json(args: argparse.Namespace) -> int:
    """`--from-json PATH`: summarize a saved document's requests again (current metrics), start nothing."""
    try:
        doc = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        records = report.records_from_document(doc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"mlx-trio bench: cannot read {args.from_json}: {exc}", file=sys.stderr)
        return 2
    _report(args, records, doc["meta"])
    return 0


def _report(args: argparse.Namespace, records: list[RunRecord], meta: dict[str, Any]) -> None:
    summaries = _summaries(records)
    print(f"\nworkload {meta['workload']}: {meta['workload_line']}\n")
    print(report.markdown_table(summaries))
    if meta["workload"] == "long-context" or any(r.rate_per_s is not None for r in records):
        target = getattr(args, "ttft_target", long_context.DEFAULT_TTFT_TARGET_S)
        print("\n" + long_context.markdown(_load_summaries(records, target), ttft_target_s=target))
    if text := report.notes(summaries):
        print("\n" + text)
    started = [(s["name"], s["startup_s"]) for s in meta.get("servers", []) if s.get("startup_s") is not None]
    if started:
        print("\nstart-up (launch to ready): " + ", ".join(f"{name} {t:.1f} s" for name, t in started))
    print(f"\n{meta['machine_line']}\ncommand: {meta['command']}")
    if meta.get("interrupted"):
        print("interrupted: the table holds the runs that finished before the bench was stopped")
    if args.out is not None:
        report.write_json(args.out, report.document(summaries, records, meta))
    if args.plot is not None:
        report.write_plot(args.plot, summaries, f"mlx-trio bench: {meta['workload']}")


async def _bench(args: argparse.Namespace, servers: list[Any], params: workloads.WorkloadParams,
                 options: RunOptions, records: list[RunRecord]) -> bool:
    """`_measure` into `records`; False if SIGTERM (`timeout`, a job runner) stopped it first."""
    return await until_sigterm(partial(_measure, args, servers, params, options, records))


async def until_sigterm(run: Callable[[], Awaitable[None]]) -> bool:
    """`run()`; False if SIGTERM stopped it first.

    SIGTERM is taken as a Trio signal rather than a Python handler raising
    mid-step, so that the cancellation unwinds cleanly and the caller still
    stops the servers and reports the runs that finished. An exception of
    `run` (say a `ServerStartError`) is raised as itself, outside the
    nursery's exception group. Off the main thread no signal can be received,
    and `run` runs unwatched.
    """
    outcome: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        async def watch_sigterm() -> None:
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

        async def measure() -> None:
            try:
                await run()
                outcome["done"] = True
            except Exception as exc:  # re-raised below, outside the nursery's exception group
                outcome["error"] = exc
            nursery.cancel_scope.cancel()

        if threading.current_thread() is threading.main_thread():
            nursery.start_soon(watch_sigterm)
        nursery.start_soon(measure)
    if "error" in outcome:
        raise outcome["error"]
    return bool(outcome.get("done"))


async def _measure(args: argparse.Namespace, servers: list[Any], params: workloads.WorkloadParams,
                   options: RunOptions, records: list[RunRecord]) -> None:
    # Servers the bench starts run one at a time: each starts, runs all its rounds and stops before the next
    # starts, so no other server holds device memory beside the one measured (H100, 2026-12-05: an idle
    # mlx_lm.server beside ours held 56 GiB, and ours, following what other processes take, answered 503s).
    # Servers it was only given (`--url`) are shared as they are: their rounds alternate A B A B.
    managed = [s for s in servers if isinstance(s, ManagedServer)]
    given = [s for s in servers if not isinstance(s, ManagedServer)]
    for group in [given] * bool(given) + [[s] for s in managed]:
        for server in group:
            if isinstance(server, ManagedServer):
                await server.start()
        try:
            await _measure_group(args, group, params, options, records)
        finally:
            for server in group:
                server.stop()


async def _measure_group(args: argparse.Namespace, servers: list[Any], params: workloads.WorkloadParams,
                         options: RunOptions, records: list[RunRecord]) -> None:
    """Every rate (or the one run) of the workload against `servers`, already up, alternated A B A B."""
    for server in servers:
        result = await warmup(server.url, options)
        if not result.ok:
            log.warning("%s: warmup request failed: %s", server.name, result.error)
    for k, rate in enumerate(getattr(args, "rates", None) or [None]):
        # A sweep runs the whole matrix once per rate, each record remembering its rate, and gives each rate
        # its own seeds, so that no rate finds an earlier rate's prompts in a prefix cache.
        first = len(records)
        rated = params if rate is None else attrs.evolve(params, rate_per_s=rate, seed=params.seed * 100 + k)
        await run_matrix(servers, args.workload, rated, args.concurrency, args.rounds, options,
                         requests_per_stream=args.requests_per_stream, progress=choose(not args.no_progress),
                         records=records)
        records[first:] = [attrs.evolve(r, rate_per_s=rated.rate_per_s) for r in records[first:]]


def _load_summaries(records: list[RunRecord], ttft_target_s: float) -> list[long_context.LoadSummary]:
    """One per (server, rate): the long-context report's rows (bench/long_context.py)."""
    groups: dict[tuple[float | None, str], list[RunRecord]] = {}
    order = {server: i for i, server in enumerate(dict.fromkeys(r.server for r in records))}  # the table's order
    for record in records:
        groups.setdefault((record.rate_per_s, record.server), []).append(record)
    return [long_context.summarize_load(server, rate, [r.results for r in runs], ttft_target_s=ttft_target_s)
            for (rate, server), runs in sorted(groups.items(), key=lambda kv: (order[kv[0][1]], kv[0][0] or 0.0))]


def _summaries(records: list[RunRecord]) -> list[metrics.Summary]:
    groups: dict[tuple[int, str], list[RunRecord]] = {}
    for record in records:
        groups.setdefault((record.concurrency, record.server), []).append(record)
    return [metrics.summarize(server, concurrency, [r.results for r in runs],
                              server_died=any(r.server_died for r in runs),
                              gpu_busy=[r.gpu_busy_percent for r in runs if r.gpu_busy_percent is not None])
            for (concurrency, server), runs in groups.items()]


def _servers(args: argparse.Namespace, model: str | None, log_dir: Path) -> list[Any]:
    servers: list[Any] = []
    names: set[str] = set()
    for index, (kind, value) in enumerate(args.targets):
        if kind == "serve":
            name = _unique(value, names)
            extra = args.mlx_lm_args if value == "mlx_lm" else args.ours_args
            servers.append(ManagedServer(name, value, str(model), log_dir / f"{name}.log", python=args.python,
                                         extra_args=tuple(extra), startup_timeout_s=args.startup_timeout_s,
                                         env=STACK_ENV.get(value, {})))
        else:
            name, _, url = value.partition("=") if "=" in value.split("://")[0] else ("", "", value)
            servers.append(UrlServer(_unique(name or f"url{index + 1}", names), url))
    return servers


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}-{n}", n + 1
    taken.add(candidate)
    return candidate


def _describe(server: Any) -> dict[str, Any]:
    if isinstance(server, ManagedServer):
        return {"name": server.name, "stack": server.stack, "extra_args": list(server.extra_args),
                "restarts": server.restarts, "startup_s": server.startup_s}
    return {"name": server.name, "url": server.url}


def _eos_ids(args: argparse.Namespace, model: str | None) -> tuple[int, ...]:
    if args.no_eos_bias:
        return ()
    if args.eos_id:
        return tuple(sorted(set(args.eos_id)))
    ids = eos_token_ids(model) if model else ()
    if not ids:
        print("mlx-trio bench: warning: no EOS id known (pass --eos-id or --model DIR); outputs may stop early",
              file=sys.stderr)
    return ids
