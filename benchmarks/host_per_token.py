"""Host CPU seconds per streamed token of `mlx-trio serve` at c=64, measured from outside the server (issue #20).

Usage (this box, CPU backend):
    python benchmarks/host_per_token.py                          # this checkout alone
    python benchmarks/host_per_token.py --src /tmp/base20        # A/B against another checkout

Each server runs the tiny random llama (no EOS, so every row streams exactly
`--output-tokens`) with `--batch` rows, as its own process; `--src DIR`
starts the second one from DIR's package (cwd and PYTHONPATH), so "now" and
a baseline run on the same box in the same run. Per round, each server gets
`--requests` streamed chat completions, `--concurrency` at once, from this
process (`mlx_trio.bench.runner`), in alternating order (A B, then B A).
Around each run the `/proc/PID/stat` and `/proc/PID/task/*/stat` of every process of the server
(with front processes, the default: the launcher, the engine's process and the fronts; the busiest
process's threads are split as below, the others count as "other")
are read: host CPU per streamed token = the process's CPU seconds over the
run / the tokens its usage chunks report. Per thread too: the main thread
(tid = pid) is the Trio thread; the busiest other thread is, on MLX's CPU
backend, MLX's own compute thread (it runs every kernel: with the CPU wheel's
reference BLAS most of the total), elsewhere the GPU lease's; the rest are
summed (`serving_profile.py --tiny` names every thread). Linux only.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from mlx_trio.bench import workloads
from mlx_trio.bench.runner import RunOptions, run_workload
from mlx_trio.bench.servers import ManagedServer
from mlx_trio.profiling import thread_cpu
from mlx_trio.testing.shaped_models import resolve_model

HERE = Path(__file__).resolve().parents[1]


def thread_split(pid: int, start: dict[int, thread_cpu.TaskCpu],
                 end: dict[int, thread_cpu.TaskCpu]) -> dict[str, float]:
    """CPU seconds between two snapshots: the main thread, the busiest other one ("lease"; see the module docstring), the rest."""
    used = {tid: task.cpu_s - (start[tid].cpu_s if tid in start else 0.0) for tid, task in end.items()}
    main = used.pop(pid, 0.0)
    busiest = max(used.values(), default=0.0)
    return {"trio": main, "lease": busiest, "other": sum(used.values()) - busiest}


async def one_run(server: ManagedServer, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    params = workloads.WorkloadParams(num_requests=args.requests, seed=seed, prompt_words=args.prompt_words,
                                      output_tokens=args.output_tokens)
    workload = workloads.build("uniform", params, args.concurrency)
    assert server.pid is not None
    # Every process of the server (with front processes: the launcher, the engine's process and the fronts).
    pids = thread_cpu.process_tree(server.pid)
    cpu0, t0 = {p: thread_cpu.process_cpu_s(p) for p in pids}, time.perf_counter()
    tasks0 = {p: thread_cpu.tasks(p) for p in pids}
    results = await run_workload(server.url, workload, RunOptions())
    cpu1, t1 = {p: thread_cpu.process_cpu_s(p) for p in pids}, time.perf_counter()
    tasks1 = {p: thread_cpu.tasks(p) for p in pids}
    if None in cpu0.values() or None in cpu1.values():
        raise SystemExit("host_per_token: needs Linux's /proc (and every server process alive through the run)")
    used = {p: cpu1[p] - cpu0[p] for p in pids}  # type: ignore[operator]
    tokens = sum(r.completion_tokens or 0 for r in results if r.ok)
    busiest = max(pids, key=lambda p: used[p])  # the engine's process: its threads are split below
    split = thread_split(busiest, tasks0[busiest], tasks1[busiest])
    split["other"] += sum(used.values()) - used[busiest]  # the launcher and the fronts
    cpu0, cpu1 = sum(cpu0.values()), sum(cpu1.values())  # type: ignore[arg-type]
    return {"server": server.name, "wall_s": t1 - t0, "tokens": tokens, "failures": sum(not r.ok for r in results),
            "cpu_s": cpu1 - cpu0, "us_per_token": 1e6 * (cpu1 - cpu0) / max(tokens, 1),
            **{f"{k}_us_per_token": 1e6 * v / max(tokens, 1) for k, v in split.items()},
            "tok_s": tokens / (t1 - t0), "errors": sorted({r.error or "" for r in results if not r.ok})}


async def bench(servers: list[ManagedServer], args: argparse.Namespace) -> list[dict[str, Any]]:
    for server in servers:
        await server.start()
        # Warm-up: the same shape of load, so compilation and first-use costs fall outside the rounds.
        await one_run(server, argparse.Namespace(**{**vars(args), "requests": args.concurrency}), seed=10**6)
    runs = []
    for round_index in range(args.rounds):
        order = servers if round_index % 2 == 0 else servers[::-1]
        for server in order:
            run = await one_run(server, args, seed=round_index)
            run["round"] = round_index
            runs.append(run)
            print(f"  round {round_index + 1} {run['server']}: {run['us_per_token']:.0f} µs/token "
                  f"({run['tokens']} tokens, {run['tok_s']:.0f} tok/s, {run['failures']} failed"
                  f"{': ' + '; '.join(run['errors']) if run['errors'] else ''})", flush=True)
    return runs


COLUMNS = ("us_per_token", "lease_us_per_token", "trio_us_per_token", "other_us_per_token", "tok_s")


def report(runs: list[dict[str, Any]], names: list[str]) -> None:
    print("\n| server | host CPU µs/token | busiest other thread (CPU backend: MLX's kernels) | Trio thread | other threads "
          "| agg tok/s | failures |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    medians = {}
    for name in names:
        mine = [r for r in runs if r["server"] == name]
        medians[name] = {c: statistics.median(r[c] for r in mine) for c in COLUMNS}
        m = medians[name]
        print(f"| {name} | {m['us_per_token']:.0f} | {m['lease_us_per_token']:.0f} | {m['trio_us_per_token']:.0f} | "
              f"{m['other_us_per_token']:.0f} | {m['tok_s']:.0f} | {sum(r['failures'] for r in mine)} |")
    if len(names) == 2:
        a, b = names
        ratios = [ra["us_per_token"] / rb["us_per_token"]
                  for ra, rb in zip([r for r in runs if r["server"] == a], [r for r in runs if r["server"] == b])]
        print(f"\n{a}/{b} host CPU per token: median {statistics.median(ratios):.2f} "
              f"(per round: {', '.join(f'{x:.2f}' for x in ratios)}); lease thread "
              f"{medians[a]['lease_us_per_token'] / medians[b]['lease_us_per_token']:.2f}, Trio thread "
              f"{medians[a]['trio_us_per_token'] / medians[b]['trio_us_per_token']:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, default=None, help="another checkout to measure against (its repo root)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="the servers' --batch")
    p.add_argument("--requests", type=int, default=128, help="requests per run")
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--shape", default="tiny", help="a benchmark shape (tiny on CPU)")
    p.add_argument("--server-args", default="", help="more flags for both servers")
    args = p.parse_args()
    if args.src is not None and not (args.src / "mlx_trio").is_dir():
        p.error(f"--src {args.src}: no mlx_trio package there")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, label = resolve_model(Path(tmp), shape=args.shape, model=None, num_layers=None)
        extra = ("--batch", str(args.batch), *args.server_args.split())
        servers = [ManagedServer("now", "ours", str(model_dir), Path(tmp) / "now.log", extra_args=extra, cwd=str(HERE),
                                 env={"PYTHONPATH": str(HERE)})]
        if args.src is not None:
            src = str(args.src.resolve())
            servers.append(ManagedServer("base", "ours", str(model_dir), Path(tmp) / "base.log", extra_args=extra,
                                         cwd=src, env={"PYTHONPATH": src}))
        print(f"# {label}; c={args.concurrency}, --batch {args.batch}, {args.requests} requests/run, "
              f"{args.prompt_words}-word prompts, {args.output_tokens} tokens each; {sys.version.split()[0]}")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` still stops the servers below
        try:
            runs = trio.run(bench, servers, args)
        finally:
            for server in servers:
                server.stop()
    report(runs, [s.name for s in servers])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
