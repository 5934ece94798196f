"""Where a serving load's host time goes: `mlx-trio serve` under MLX_TRIO_PROFILE, per concurrency (issue #20).

Usage:
    python benchmarks/serving_profile.py --tiny                       # this CPU, tiny random llama, ~1 min
    python benchmarks/serving_profile.py --model /tmp/mlx-trio-gpu-models/llama-1b   # the H200 (gpu.sh PARTS=profile)

For each `--concurrency` (and each `--workloads` entry) a fresh server starts
with `MLX_TRIO_PROFILE` set (`mlx_trio/profiling`; EOS removed from a copy
of the model, so no row needs a `logit_bias` but the ones the workload gives
it), is warmed up, and gets SIGUSR1 just before and just after the measured
run, so the profile's window 1 is exactly the run. The run is `mlx-trio
bench`'s runner (`--workload serving` by default: log-uniform prompts, Poisson
arrivals, mixed per-row sampling; GPU busy from `nvidia-smi` where it
exists). One markdown table, one row per run: aggregate tok/s, TTFT
p50/p95, failures, the lease's busy fraction (time inside jobs / wall), GPU
busy, and the lease and Trio threads' CPU µs per streamed token, decode
step, lease job and request; then per run the top jobs and the top sampled
functions of each thread. `--json` keeps every window of every profile.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from mlx_trio.bench import metrics, workloads
from mlx_trio.bench.runner import RunOptions, run_matrix, run_workload, warmup
from mlx_trio.bench.servers import ManagedServer, plans_settled
from mlx_trio.profiling import MARK_SIGNAL, PROFILE_ENV
from mlx_trio.profiling.recorder import LEASE_THREAD, TRIO_THREAD
from mlx_trio.testing.shaped_models import resolve_model

TOP = 5
UNITS = ("token", "step", "job", "request")


def _windows(path: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads(path.read_text())["windows"])
    except (OSError, ValueError, KeyError):
        return []


async def mark(server: ManagedServer, path: Path, windows: int) -> None:
    """Cut the server's profile window and wait until the file holds `windows` windows."""
    assert server.pid is not None and MARK_SIGNAL is not None
    os.kill(server.pid, MARK_SIGNAL)
    with trio.fail_after(30):
        while len(_windows(path)) < windows:
            await trio.sleep(0.02)


async def profile_one(model: str, workload: str, concurrency: int, args: argparse.Namespace,
                      workdir: Path, live: list[ManagedServer]) -> dict[str, Any]:
    """One server, one workload at one concurrency: the bench summary and the profile's measured window.

    The server is in `live` while it runs, so that `main` stops it whatever ends the run.
    """
    path = workdir / f"profile-{workload}-c{concurrency}.json"
    batch = max(8, min(concurrency, args.batch_cap))
    server = ManagedServer(f"ours-c{concurrency}", "ours", model, workdir / f"{workload}-c{concurrency}.log",
                           extra_args=("--batch", str(batch), *args.server_args.split()),
                           env={PROFILE_ENV: str(path)})
    params = workloads.WorkloadParams(
        num_requests=max(args.requests, args.requests_per_stream * concurrency), seed=args.seed,
        rate_per_s=args.rate if args.rate else concurrency / 2, output_tokens=args.output_tokens,
        max_output_tokens=args.max_output_tokens, min_prompt_words=args.min_prompt_words,
        max_prompt_words=args.max_prompt_words, system_words=args.system_words, prompt_words=args.prompt_words)
    options = RunOptions(read_timeout_s=600.0)
    live.append(server)
    try:
        await server.start()
        await warmup(server.url, options)
        # A short run of the same mix (short prompts), so each sampling option's first-use cost stays outside.
        warm = workloads.build(workload, attrs.evolve(params, num_requests=min(concurrency, 16), seed=10**6,
                                                      rate_per_s=None, max_prompt_words=params.min_prompt_words,
                                                      output_tokens=8, max_output_tokens=8), concurrency)
        await run_workload(server.url, warm, options)
        # Idle-time cuDNN plans are lease jobs: not inside the measured window.
        print(f"# attention {await plans_settled(server.url)}", flush=True)
        await mark(server, path, 1)
        (record,) = await run_matrix([server], workload, params, [concurrency], 1, options)
        await mark(server, path, 2)
    finally:
        server.stop()
    summary = metrics.summarize(server.name, concurrency, [record.results],
                                gpu_busy=[record.gpu_busy_percent] if record.gpu_busy_percent is not None else [])
    return {"workload": workload, "concurrency": concurrency, "batch": batch, "summary": attrs.asdict(summary),
            "window": _windows(path)[1], "profile": _windows(path)}


def _f(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "" if value is None else f"{value * scale:.{digits}f}"


def table(runs: list[dict[str, Any]]) -> None:
    """One markdown row per run."""
    per = " | ".join(f"{t} µs/{u}" for u in UNITS for t in ("lease", "Trio"))
    print("\n| workload | c | --batch | agg tok/s | TTFT p50 ms | TTFT p95 ms | failures | lease busy % "
          f"| GPU busy % | {per} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (2 * len(UNITS)))
    for run in runs:
        s, w = run["summary"], run["window"]
        costs = " | ".join(_f(w["per_unit_us"][thread][u]) for u in UNITS for thread in (LEASE_THREAD, TRIO_THREAD))
        print(f"| {run['workload']} | {run['concurrency']} | {run['batch']} | {_f(s['output_tok_s'])} | "
              f"{_f(s['ttft_p50_s'], 1e3)} | {_f(s['ttft_p95_s'], 1e3)} | {s['num_failed']} | "
              f"{_f(w['lease_busy_fraction'], 100, 1)} | {_f(s['gpu_busy_percent'], 1, 1)} | {costs} |")


# Arrivals this far apart start a new burst (`bursts`).
BURST_GAP_MS = 20.0


def bursts(window: dict[str, Any], shown: int = 4) -> None:
    """Per burst of arrivals (a closed loop's waves): when its rows reached prefill, token 0 and first text, and
    the lease's jobs from its first arrival to its last token 0 (name x count, ms; then the sequence, runs of
    one name folded), so a wave's wait for its first tokens reads as the jobs it waited behind."""
    trace = window.get("timeline")
    if not trace or not trace["requests"]:
        return
    rows = sorted((p for p in trace["requests"].values() if "arrived" in p), key=lambda p: p["arrived"])
    groups: list[list[dict[str, float]]] = []
    for p in rows:
        if groups and p["arrived"] - groups[-1][-1]["arrived"] <= BURST_GAP_MS:
            groups[-1].append(p)
        else:
            groups.append([p])
    print(f"bursts: {len(groups)} (arrivals > {BURST_GAP_MS:.0f} ms apart start one); the first {shown} after the first:")
    for group in groups[1:1 + shown]:
        t0 = group[0]["arrived"]

        def spread(phase: str) -> str:
            at = sorted(p[phase] - t0 for p in group if phase in p)
            return f"{len(at)} in {at[0]:.0f}..{at[-1]:.0f}" if at else "none"

        cohorts: dict[float, int] = {}
        for p in group:
            if "prefill" in p:
                cohorts[round(p["prefill"] - t0, 1)] = cohorts.get(round(p["prefill"] - t0, 1), 0) + 1
        end = max((p.get("token0", t0) for p in group), default=t0)
        jobs = [j for j in trace["jobs"] if t0 <= j[1] <= end]
        by: dict[str, list[float]] = {}
        for name, _, ms in jobs:
            by.setdefault(name, []).append(ms)
        folded: list[str] = []
        for name, start, ms in jobs:
            label = f"{name}@{start - t0:.0f}:{ms:.1f}"
            if folded and folded[-1].split("@")[0] == name and name.startswith("_steps"):
                continue
            folded.append(label)
        print(f"  burst at {t0:.0f} ms, {len(group)} rows: arrived {spread('arrived')}, prepared {spread('prepared')}, "
              f"prefill {spread('prefill')}, token0 {spread('token0')}, first text {spread('first_text')} (ms)")
        print("    prefill starts (ms: rows): " + ", ".join(f"{at:.0f}: {n}" for at, n in sorted(cohorts.items())))
        print("    jobs to the last token 0: " + "; ".join(f"{name} x{len(ms)} {sum(ms):.1f} ms (max {max(ms):.1f})"
                                                        for name, ms in sorted(by.items(), key=lambda kv: -sum(kv[1]))))
        print("    sequence: " + " ".join(folded[:60]) + (" ..." if len(folded) > 60 else ""))
        parts = [f"{name}@{start - t0:.0f}:{ms:.1f}" for name, start, ms in trace.get("spans", []) if t0 <= start <= end]
        if parts:
            print("    job parts: " + " ".join(parts[:80]) + (" ..." if len(parts) > 80 else ""))


def details(run: dict[str, Any]) -> None:
    """The measured window's counts, thread CPU, top jobs and top sampled functions of the lease and Trio threads."""
    w = run["window"]
    counts = w["counts"]
    print(f"\n#### {run['workload']}, c={run['concurrency']}: {w['wall_s']:.1f} s, {counts['tokens']:.0f} tokens, "
          f"{counts['steps']:.0f} steps, {counts['lease_jobs']} lease jobs, "
          f"{counts['requests']:.0f} requests; process CPU {_f(w['process_cpu_s'], 1, 1)} s")
    threads = ", ".join(f"{name} {u['cpu_s']:.2f} s" for name, u in
                        sorted(w["threads"].items(), key=lambda kv: -kv[1]["cpu_s"])[:6])
    print(f"thread CPU: {threads}")
    print("jobs: " + "; ".join(f"{name} ×{j['count']} {j['total_s']:.2f} s (p50 {j['p50_ms']:.2f} / p95 "
                               f"{j['p95_ms']:.2f} / max {j['max_ms']:.1f} ms)"
                               for name, j in list(w["jobs"].items())[:TOP]))
    phases = {step: v for step, v in w.get("requests", {}).items() if isinstance(v, dict)}
    if phases:  # where the first token waits (mlx_trio/profiling/requests.py)
        print("to first text, ms p50 / p95 / max: " + "; ".join(
            f"{step} {v['p50_ms']:.0f} / {v['p95_ms']:.0f} / {v['max_ms']:.0f}" for step, v in phases.items()))
    bursts(w)
    for thread in (LEASE_THREAD, TRIO_THREAD):
        sampled = w["samples"].get(thread)
        if not sampled or not sampled["samples"]:
            continue
        n = sampled["samples"]
        for kind in ("self", "cumulative"):
            # Frames on every sample (the thread's bootstrap, the lease's job loop) say nothing.
            entries = [(name, c) for name, c in sampled[kind] if c < n][:TOP]
            top = ", ".join(f"{name} {100 * c / n:.0f}%" for name, c in entries)
            print(f"{thread} {kind} ({n} samples): {top}")


async def bench(model: str, args: argparse.Namespace, workdir: Path, live: list[ManagedServer]) -> list[dict[str, Any]]:
    """Every (concurrency, workload) in turn; each run's own table as it ends (a time-out keeps those)."""
    runs = []
    for concurrency in args.concurrency:
        for workload in args.workloads:
            start = time.perf_counter()
            runs.append(await profile_one(model, workload, concurrency, args, workdir, live))
            print(f"\n## {workload} c={concurrency} ({time.perf_counter() - start:.0f} s with the server's start)")
            table(runs[-1:])
            details(runs[-1])
            if args.json is not None:
                write(args, runs)
    return runs


def write(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny random llama on this CPU, small requests (< 2 min)")
    p.add_argument("--model", default=None, help="a model directory (an EOS-free copy is served)")
    p.add_argument("--shape", default=None, help="a benchmark shape to build instead (testing/shaped_models)")
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[8, 64, 256])
    p.add_argument("--workloads", type=lambda t: t.split(","), default=["serving"],
                   help="comma list of bench workloads, e.g. serving,agents (default: serving)")
    p.add_argument("--batch-cap", type=int, default=64, help="--batch is the concurrency, at least 8, at most this")
    p.add_argument("--requests", type=int, default=32, help="requests per run, at least")
    p.add_argument("--requests-per-stream", type=int, default=1)
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default: concurrency / 2)")
    p.add_argument("--prompt-words", type=int, default=512, help="uniform: every prompt's words")
    p.add_argument("--min-prompt-words", type=int, default=25, help="about 100 tokens with the shapes' small BPE")
    p.add_argument("--max-prompt-words", type=int, default=2500, help="about 10k tokens with the shapes' small BPE")
    p.add_argument("--output-tokens", type=int, default=128, help="the shortest output")
    p.add_argument("--max-output-tokens", type=int, default=512)
    p.add_argument("--system-words", type=int, default=600, help="agents: the shared system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="more flags for mlx-trio serve")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if MARK_SIGNAL is None:
        p.error("needs SIGUSR1 (Linux or macOS)")
    if args.tiny:
        args.shape = args.shape or "tiny"
        args.min_prompt_words, args.max_prompt_words = 10, min(args.max_prompt_words, 300)
        args.output_tokens, args.max_output_tokens = 16, min(args.max_output_tokens, 48)
        args.system_words = min(args.system_words, 100)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, label = resolve_model(Path(tmp), shape=args.shape, model=args.model, num_layers=None)
        print(f"# serving profile: {label}; workloads {','.join(args.workloads)}, c={args.concurrency}, "
              f"prompts {args.min_prompt_words}-{args.max_prompt_words} words, outputs "
              f"{args.output_tokens}-{args.max_output_tokens} tokens; python {sys.version.split()[0]}", flush=True)
        live: list[ManagedServer] = []
        # SIGTERM (gpu.sh's `timeout`) unwinds like an exit, so the servers below are stopped, not orphaned.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            runs = trio.run(bench, str(model_dir), args, Path(tmp), live)
        finally:
            for server in live:
                server.stop()
    print("\n## all runs (details above, per run)")
    table(runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
