"""Does the lease thread's CPU per decode step depend on where the OS runs it? (issue #20)

Usage:
    python benchmarks/lease_affinity.py --tiny                                   # this CPU, seconds
    python benchmarks/lease_affinity.py --model /tmp/mlx-trio-gpu-models/llama-1b  # the H200

On the H200's host the lease thread's CPU per decode step of one unchanged load
swings from 3.1 to 5.2 ms between runs on one instance (docs/benchmarks.md,
fifteenth pass, call 4), and the decode rate with it. One candidate is the
scheduler moving the lease thread between cores (cold caches, another NUMA
node). This decodes B rows with `engine_run` (batch_throughput.py) in rounds
that alternate "free" (every thread may run on every allowed CPU, the
default) and "pinned" (the lease thread alone on one CPU, every other thread
of the process kept off it), and prints the decode window's tok/s and the
lease and Trio threads' CPU µs a step per round and as medians.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from mlx_trio import open_engine
from mlx_trio.testing.shaped_models import resolve_model

from batch_throughput import FIRST_PROMPT_ID, PROMPT_ID_LIMIT, SERVE_SWITCH_INTERVAL_S, engine_run

KEYS = ("dec_tok_s", "job_ms_per_step", "lease_cpu_us_per_step", "trio_cpu_us_per_step")


def prompts(rows: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(PROMPT_ID_LIMIT, vocab)
    return [[rng.randrange(FIRST_PROMPT_ID, hi) for _ in range(tokens)] for _ in range(rows)]


def place(pinned: bool, cpus: set[int], lease_tid: int) -> None:
    """Pin the lease thread to one CPU and every other thread of this process off it, or free them all."""
    lease_cpu = max(cpus)
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            if not pinned:
                os.sched_setaffinity(tid, cpus)
            elif tid == lease_tid:
                os.sched_setaffinity(tid, {lease_cpu})
            else:
                os.sched_setaffinity(tid, cpus - {lease_cpu})
        except OSError:
            pass  # a thread that just ended


async def bench(model: str, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {"free": [], "pinned": []}
    cpus = os.sched_getaffinity(0)
    async with open_engine(model, batch=args.rows, cudnn_warm_tokens=0) as engine:
        lease_tid = engine.actors.lane.lease.statistics().thread_id
        vocab = engine.model.vocab_size
        await engine_run(engine, prompts(args.rows, args.tokens, vocab, 10**6), 8)  # warm-up
        for r in range(args.rounds):
            order = ["free", "pinned"] if r % 2 == 0 else ["pinned", "free"]
            for kind in order:
                place(kind == "pinned", cpus, lease_tid)
                out = await engine_run(engine, prompts(args.rows, args.tokens, vocab, r), args.output_tokens)
                runs[kind].append(out)
                print(f"  round {r + 1} {kind}: " + ", ".join(f"{k} {out.get(k) or 0:.1f}" for k in KEYS), flush=True)
        place(False, cpus, lease_tid)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny random llama on this CPU")
    p.add_argument("--model", default=None)
    p.add_argument("--shape", default=None)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.rows, args.output_tokens, args.rounds = "tiny", 16, 24, 2
    if len(os.sched_getaffinity(0)) < 2:
        p.error("needs at least 2 CPUs to pin the lease thread apart")
    sys.setswitchinterval(SERVE_SWITCH_INTERVAL_S)
    with tempfile.TemporaryDirectory(prefix="mlx-trio-lease-affinity-") as tmp:
        model_dir, label = resolve_model(Path(tmp), shape=args.shape, model=args.model, num_layers=None)
        print(f"# lease affinity: {label}; B={args.rows}, {args.tokens}-token prompts, {args.output_tokens} tokens, "
              f"{args.rounds} rounds, CPUs {sorted(os.sched_getaffinity(0))}", flush=True)
        runs = trio.run(bench, str(model_dir), args)
    print("\n| threads | " + " | ".join(KEYS) + " |\n|---|" + "---:|" * len(KEYS))
    for kind, rs in runs.items():
        cells = [statistics.median(r.get(k) or 0.0 for r in rs) for k in KEYS]
        print(f"| {kind} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
