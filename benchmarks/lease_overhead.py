"""Measure what the GPU lease costs per job, against trio.to_thread and a plain thread.

Usage:
    python benchmarks/lease_overhead.py [--calls 5000] [--concurrency 8] [--repeat 3] [--json out.json]

Each round measures, for `GpuLease` and for `trio.to_thread.run_sync` with a
private `CapacityLimiter(1)` (the bridge the lease replaces; docs/gpu-lease.md):

* no-op round trip (submit -> result back in the caller): median and p99 µs,
  and sequential calls/s;
* calls/s with ``--concurrency`` tasks calling at once;
* a tiny MLX job, ``(x + 1).item()`` on an evaluated scalar, whose median is
  compared with the same function called in a loop on a plain thread with no
  Trio at all ("inline"): the difference is the bridge's overhead on real work.

Rounds alternate the bridges so that a noisy neighbour hits both alike; the
table shows the median over rounds and the min-max range. The main thread never
touches MLX: every MLX call runs on the lease thread, a to_thread worker, or the
inline thread, and each of those releases its streams before the run ends.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from mlx_trio.actors.gpu_lease import GpuLease, open_gpu_lease
from mlx_trio.engine.lease_thread import release_thread_streams

Call = Callable[..., Awaitable[Any]]
WARMUP_CALLS = 200


def noop() -> None:
    return None


def make_scalar() -> Any:
    import mlx.core as mx

    x = mx.array(1.0)
    mx.eval(x)  # evaluated, so any thread may read it
    return x


def tiny_job(x: Any) -> float:
    return (x + 1).item()  # type: ignore[no-any-return]


def describe_device() -> str:
    import mlx.core as mx

    return str(mx.default_device())


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summarize(per_call_us: list[float], total_s: float) -> dict[str, float]:
    ordered = sorted(per_call_us)
    return {
        "median_us": statistics.median(ordered),
        "p99_us": percentile(ordered, 0.99),
        "calls_per_s": len(ordered) / total_s,
    }


async def sequential(call: Call, fn: Callable[..., Any], args: tuple[Any, ...], n: int) -> dict[str, float]:
    for _ in range(WARMUP_CALLS):
        await call(fn, *args)
    samples = []
    clock = time.perf_counter
    start = clock()
    for _ in range(n):
        t0 = clock()
        await call(fn, *args)
        samples.append((clock() - t0) * 1e6)
    return summarize(samples, clock() - start)


async def concurrent(call: Call, n: int, concurrency: int) -> float:
    per_task = max(1, n // concurrency)

    async def caller() -> None:
        for _ in range(per_task):
            await call(noop)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(caller)
    return per_task * concurrency / (time.perf_counter() - start)


def inline_loop(n: int, out: dict[str, float]) -> None:
    """The tiny MLX job in a plain thread with no Trio: the floor for any bridge."""
    try:
        x = make_scalar()
        for _ in range(WARMUP_CALLS):
            tiny_job(x)
        samples = []
        start = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            tiny_job(x)
            samples.append((time.perf_counter() - t0) * 1e6)
        out.update(summarize(samples, time.perf_counter() - start))
    finally:
        release_thread_streams()


async def run_inline(n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    thread = threading.Thread(target=inline_loop, args=(n, out), name="inline-baseline")
    thread.start()
    while thread.is_alive():  # poll rather than block the event loop in join()
        await trio.sleep(0.01)
    return out


async def measure_round(
    lease: GpuLease, limiter: trio.CapacityLimiter, x: Any, to_thread_threads: set[int], args: argparse.Namespace
) -> dict[str, Any]:

    async def via_lease(fn: Callable[..., Any], *a: Any) -> Any:
        return await lease.run(fn, *a)

    async def via_to_thread(fn: Callable[..., Any], *a: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *a, limiter=limiter)

    def tiny_job_tracked(x: Any) -> float:
        to_thread_threads.add(threading.get_ident())
        return tiny_job(x)

    result: dict[str, Any] = {"lease": {}, "to_thread": {}}
    result["lease"]["noop"] = await sequential(via_lease, noop, (), args.calls)
    result["to_thread"]["noop"] = await sequential(via_to_thread, noop, (), args.calls)
    result["lease"]["concurrent_calls_per_s"] = await concurrent(via_lease, args.calls, args.concurrency)
    result["to_thread"]["concurrent_calls_per_s"] = await concurrent(via_to_thread, args.calls, args.concurrency)
    result["inline_mlx"] = await run_inline(args.calls)
    result["lease"]["mlx"] = await sequential(via_lease, tiny_job, (x,), args.calls)
    result["to_thread"]["mlx"] = await sequential(via_to_thread, tiny_job_tracked, (x,), args.calls)
    result["to_thread"]["mlx_threads_so_far"] = len(to_thread_threads)
    return result


def release_and_ident() -> int:
    release_thread_streams()
    return threading.get_ident()


def machine_info(device: str) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": importlib.metadata.version("mlx"),
        "trio": trio.__version__,
        "mlx_device": device,
    }


def spread(rounds: list[dict[str, Any]], *path: str) -> tuple[float, float, float]:
    values = []
    for r in rounds:
        v: Any = r
        for key in path:
            v = v[key]
        values.append(float(v))
    return statistics.median(values), min(values), max(values)


def render(info: dict[str, Any], rounds: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    # (measure, GpuLease, to_thread); µs rows are costs, calls/s rows are rates.
    rows: list[tuple[str, tuple[float, float, float], tuple[float, float, float]]] = [
        ("no-op RTT median µs", spread(rounds, "lease", "noop", "median_us"), spread(rounds, "to_thread", "noop", "median_us")),
        ("no-op RTT p99 µs", spread(rounds, "lease", "noop", "p99_us"), spread(rounds, "to_thread", "noop", "p99_us")),
        ("no-op calls/s, sequential", spread(rounds, "lease", "noop", "calls_per_s"), spread(rounds, "to_thread", "noop", "calls_per_s")),
        (f"no-op calls/s, {args.concurrency} callers", spread(rounds, "lease", "concurrent_calls_per_s"), spread(rounds, "to_thread", "concurrent_calls_per_s")),
        ("tiny MLX job median µs", spread(rounds, "lease", "mlx", "median_us"), spread(rounds, "to_thread", "mlx", "median_us")),
    ]
    inline = spread(rounds, "inline_mlx", "median_us")
    overhead_lease = [r["lease"]["mlx"]["median_us"] - r["inline_mlx"]["median_us"] for r in rounds]
    overhead_to_thread = [r["to_thread"]["mlx"]["median_us"] - r["inline_mlx"]["median_us"] for r in rounds]
    as_spread = lambda vs: (statistics.median(vs), min(vs), max(vs))  # noqa: E731
    rows.append(("tiny MLX job overhead vs inline µs", as_spread(overhead_lease), as_spread(overhead_to_thread)))

    def cell(s: tuple[float, float, float]) -> str:
        fmt = "{:,.0f}" if s[0] >= 1000 else "{:.1f}"
        return f"{fmt.format(s[0])} ({fmt.format(s[1])}–{fmt.format(s[2])})"

    lines = [
        f"{info['date']}  {info['platform']}  {info['cpu_count']} CPUs  Python {info['python']}  "
        f"mlx {info['mlx']} ({info['mlx_device']})  trio {info['trio']}",
        f"{args.calls} calls per cell, {len(rounds)} rounds; median (min–max) over rounds",
        "",
        "lease advantage = to_thread cost / lease cost (for calls/s: lease rate / to_thread rate)",
        "",
        f"| {'measure':38} | {'GpuLease':24} | {'to_thread + Limiter(1)':24} | {'lease advantage':15} |",
        f"|{'-' * 40}|{'-' * 26}|{'-' * 26}|{'-' * 17}|",
    ]
    summary: dict[str, Any] = {}
    for name, lease_s, other_s in rows:
        ratio = lease_s[0] / other_s[0] if "calls/s" in name else other_s[0] / lease_s[0]
        lines.append(f"| {name:38} | {cell(lease_s):24} | {cell(other_s):24} | {ratio:14.2f}× |")
        summary[name] = {"lease": lease_s, "to_thread": other_s, "lease_advantage": ratio}
    lines.append(f"| {'tiny MLX job inline, plain thread µs':38} | {cell(inline):24} | {'':24} | {'':15} |")
    summary["tiny MLX job inline, plain thread µs"] = inline
    threads = rounds[-1]["to_thread"]["mlx_threads_so_far"]
    lines.append(f"\nto_thread ran the MLX loops on {threads} distinct worker thread(s); the lease on 1.")
    return "\n".join(lines), summary


async def main(args: argparse.Namespace) -> None:
    async with open_gpu_lease(name="bench-lease", on_thread_exit=release_thread_streams) as lease:
        info = machine_info(await lease.run(describe_device))
        x = await lease.run(make_scalar)
        limiter = trio.CapacityLimiter(1)
        to_thread_threads: set[int] = set()
        rounds = [await measure_round(lease, limiter, x, to_thread_threads, args) for _ in range(args.repeat)]
        # Every thread that ran MLX must drop its streams before exit (docs/design.md §8.2),
        # and only once: clear_streams leaves the thread unable to run MLX again. The
        # worker pool is LIFO, so this lands on the worker that ran the last loop.
        released = await trio.to_thread.run_sync(release_and_ident, limiter=limiter)
        if to_thread_threads != {released}:
            print(f"warning: to_thread ran MLX on {len(to_thread_threads)} threads; only one was released")
        lease_stats = lease.statistics()
    table, summary = render(info, rounds, args)
    print(table)
    print(f"lease after the run: jobs_run={lease_stats.jobs_run} jobs_failed={lease_stats.jobs_failed} busy_fraction={lease_stats.busy_fraction:.2f}")
    if args.json:
        payload = {"machine": info, "args": vars(args), "summary": summary, "rounds": rounds}
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per measurement (default 5000)")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent callers (default 8)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds, alternating the bridges (default 3)")
    parser.add_argument("--json", help="also write every number to this file")
    trio.run(main, parser.parse_args())
