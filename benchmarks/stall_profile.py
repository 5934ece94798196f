"""Where the decode stall goes while a long prompt prefills: stream gaps against the lease's job log.

Usage (H200, see benchmarks/gpu.sh for staging):
    python benchmarks/stall_profile.py --shape llama-1b --streams 4 --long-tokens 8500

In one process, on the embedded engine (no HTTP): `--streams` requests decode
(128-token prompts, long `max_tokens`); once all of them have tokens, one
`--long-tokens` prompt arrives, `--rounds` times one after another (fresh
prompts). Every GPU-lease job is logged (name, start, end;
`GpuLease.job_log`). Per round: the long prompt's TTFT, the lease jobs until
then by name, the largest gaps between consecutive tokens of any decoding
stream from its arrival until 1 s after its first token, and for each gap
the jobs that ran inside it and the lease's idle time there (time the lease
thread waited for Trio). `--streams 0` measures the prefill alone.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batch_throughput import SHAPES, resolve_model  # noqa: E402

from mlx_trio import open_engine  # noqa: E402
from mlx_trio.events import TextDelta  # noqa: E402


async def profile(model_dir: Path, args: argparse.Namespace) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(128)] for _ in range(args.streams)]
    async with open_engine(str(model_dir), batch=max(args.streams + 1, 2), prefill_step_size=args.prefill_step_size) as engine:
        await engine.complete(prompts[0] if prompts else [5] * 128, max_tokens=4)  # warm-up: a short request
        lease = engine.actors.lease
        times: list[list[float]] = [[] for _ in prompts]
        all_started = trio.Event()
        if not prompts:
            all_started.set()

        async def stream(i: int) -> None:
            async for event in engine.generate(prompts[i], max_tokens=args.stream_tokens):
                if isinstance(event, TextDelta):
                    times[i].extend([time.perf_counter()] * len(event.token_ids))
                    if all(times):
                        all_started.set()

        async def long() -> float:
            long_prompt = [rng.randrange(3, 500) for _ in range(args.long_tokens)]
            async for event in engine.generate(long_prompt, max_tokens=8):
                if isinstance(event, TextDelta):
                    return time.perf_counter()
            raise RuntimeError("the long prompt produced no token")

        lease.job_log = []
        rounds: list[tuple[float, float]] = []  # (arrival, first token) of each long prompt
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(stream, i)
            await all_started.wait()
            for _ in range(args.rounds):
                await trio.sleep(0.5)
                arrived = time.perf_counter()
                rounds.append((arrived, await long()))
                await trio.sleep(1.0)
            nursery.cancel_scope.cancel()
        log = lease.job_log
        lease.job_log = None
    for n, (arrived, first) in enumerate(rounds, 1):
        report(n, arrived, first, times, log, args)


def report(n: int, arrived: float, first: float, times: list[list[float]],
           log: list[tuple[str, float, float]], args: argparse.Namespace) -> None:
    """The long prompt's TTFT, the streams' largest gaps around it and the lease jobs inside them."""
    print(f"\n## round {n}: long prompt {args.long_tokens} tokens, TTFT {1e3 * (first - arrived):.0f} ms")
    window = [(name, s, e) for name, s, e in log if arrived <= s <= first]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, s, e in window:
        by_name[name].append(1e3 * (e - s))
    for name, d in sorted(by_name.items()):
        print(f"  jobs until TTFT: {name} x{len(d)}, median {statistics.median(d):.1f} ms, max {max(d):.1f} ms")
    gaps = []
    for i, ts in enumerate(times):
        for a, b in zip(ts, ts[1:]):
            if b > a and b >= arrived and a <= first + 1.0:
                gaps.append((b - a, a, b, i))
    # Every stream sees the same gap when a job stalls them all: show each moment once.
    gaps = sorted({round(a, 3): (gap, a, b, i) for gap, a, b, i in gaps}.values(), reverse=True)
    steady = sorted(b - a for ts in times for a, b in zip(ts, ts[1:]) if b > a and b < arrived)
    if steady:
        print(f"  inter-token gap before the long prompt: median {1e3 * steady[len(steady) // 2]:.1f} ms")
    for gap, a, b, i in gaps[:args.top]:
        inside = [(name, s, e) for name, s, e in log if e > a and s < b]
        busy = sum(min(e, b) - max(s, a) for _, s, e in inside)
        jobs = ", ".join(f"{name} {1e3 * (e - s):.1f} ms" for name, s, e in inside)
        print(f"  gap {1e3 * gap:7.1f} ms at +{1e3 * (a - arrived):.0f} ms: lease idle {1e3 * (gap - busy):.1f} ms; "
              f"jobs: {jobs}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=4000)
    p.add_argument("--long-tokens", type=int, default=8500)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2, help="long prompts, one after another (the first pays JIT)")
    args = p.parse_args()
    sys.setswitchinterval(0.001)  # as `mlx-trio serve`
    with tempfile.TemporaryDirectory() as tmp:
        args.model = None
        model_dir, label = resolve_model(args, Path(tmp))
        print(f"# {label}")
        trio.run(profile, model_dir, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
