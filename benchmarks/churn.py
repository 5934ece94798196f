"""Serving churn on the embedded engine: where the lease's time goes while rows join and leave all the time.

Usage:
    PYTHONPATH=$PWD python benchmarks/churn.py --tiny            # this box, CPU, < 1 min
    python benchmarks/churn.py --shape llama-1b                   # H200 (benchmarks/gpu.sh PARTS=churn)
    python benchmarks/churn.py --model DIR

In one process, no HTTP: `--concurrency` workers (64) start staggered over
`--stagger-s` and each runs requests back to back until `--requests` have
been sent: prompts of `--prompt-tokens` (100-1000, uniform), `max_tokens` of
`--output-tokens` (32-128, uniform), greedy, on a no-EOS copy of the model
(every row runs to its `max_tokens`, so rows leave on schedule). With
`--batch` = the concurrency, a row joins or leaves every couple of steps.

Every GPU-lease job is logged (`GpuLease.job_log`) and summed by name, in
these classes: `step` (the decode step chain's links), `settle` (a
membership change in one job), or where that is separate jobs `flush`, `leave`,
`join`, `cache` (a leaving row's KV for the prompt cache); `prefill` (every
prefill job: chunks, cohorts, token 0) and `other`. It prints each class's
jobs, seconds and share of the lease's busy time, the lease's idle share of
the run, the decode-step actor's chains (one per membership change, plus one
each time Trio fell behind) per generated token, and the aggregate tok/s.
`--json PATH` writes the same numbers.

`--rows-only` drives a `DecodeBatch` directly instead (no actors, no lease):
`--concurrency` rows prefilled up front, then `--settles` times: `--steps-between`
steps, then a settle as the decode-step actor does it (flush, one row leaves,
one prefilled row joins). It reports ms per step and ms per leave + join, the
membership change's own cost without the scheduling around it.

`--ab N` runs N rounds of two runs each, row slots on then off
(`MLX_TRIO_NO_ROW_SLOTS=1`, engine/kv/row_slots.py), each on a fresh engine,
and prints a summary of the pairs. A/B against another checkout: run this
script with `PYTHONPATH` set to that checkout (the script's own directory is
not a package, so `mlx_trio` comes from `PYTHONPATH`), same flags, alternating.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from mlx_trio import open_engine
from mlx_trio.events import TextDelta
from mlx_trio.testing.shaped_models import SHAPES, resolve_model

# engine/kv/row_slots.KILL_SWITCH, spelled out so that this script also runs against a checkout without it.
KILL_SWITCH = "MLX_TRIO_NO_ROW_SLOTS"
# Lease job name (its function's __qualname__, gpu_lease._name) -> class; prefill jobs are matched by module below.
CLASSES = {
    "_steps_then": "step",
    "_membership": "settle",  # actors/decode_step.py: flush + prompt-cache puts + leave + join in one job
    "DecodeBatch.flush_decoded": "flush",
    "DecodeBatch.leave": "leave",
    "DecodeBatch.join_many": "join",
    "DecodeBatch.cache_entry": "cache",
}
ORDER = ("step", "settle", "flush", "leave", "join", "cache", "prefill", "other")


def job_class(name: str) -> str:
    if name == "timed":  # actors/chunk_sizer.timed: the prefill actor's chunk and cohort jobs
        return "prefill"
    if name in CLASSES:
        return CLASSES[name]
    lowered = name.lower()
    if "prefill" in lowered or "cohort" in lowered or "solorow" in lowered or "first_token" in lowered:
        return "prefill"
    return "other"


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


async def churn(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    plan = [([rng.randrange(3, 500) for _ in range(rng.randint(*args.prompt_tokens))],
             rng.randint(*args.output_tokens)) for _ in range(args.requests)]
    tokens = 0
    async with open_engine(str(model_dir), batch=args.batch or args.concurrency,
                           prefill_step_size=args.prefill_step_size) as engine:
        await engine.complete([5] * 64, max_tokens=4)  # warm-up: a short request
        lane = engine.actors.lane
        lease, decode = lane.lease, lane.decode_step
        assert lease is not None and decode is not None
        before = decode.statistics()
        queue = collections.deque(plan)
        lease.job_log = log = []
        start = time.perf_counter()

        async def worker(i: int) -> None:
            nonlocal tokens
            await trio.sleep(args.stagger_s * i / max(1, args.concurrency))
            while queue:
                prompt, max_tokens = queue.popleft()
                async for event in engine.generate(prompt, max_tokens=max_tokens, temperature=0.0):
                    if isinstance(event, TextDelta):
                        tokens += len(event.token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(args.concurrency):
                nursery.start_soon(worker, i)
        wall = time.perf_counter() - start
        lease.job_log = None
        after = decode.statistics()
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, t0, t1 in log:
        by_name[name][0] += 1
        by_name[name][1] += t1 - t0
    classes: dict[str, list[float]] = {c: [0, 0.0] for c in ORDER}
    for name, (count, seconds) in by_name.items():
        cls = classes[job_class(name)]
        cls[0] += count
        cls[1] += seconds
    busy = sum(seconds for _, seconds in classes.values())
    chains = after.chains - before.chains
    steps = after.steps - before.steps
    return {
        "wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall, "requests": args.requests,
        "concurrency": args.concurrency, "lease_busy_s": busy, "lease_idle_share": max(0.0, 1 - busy / wall),
        "chains": chains, "steps": steps, "chains_per_token": chains / max(1, tokens),
        "steps_per_chain": steps / max(1, chains),
        "classes": {c: {"jobs": int(n), "s": s, "share": s / busy if busy else 0.0} for c, (n, s) in classes.items()},
        "jobs": {name: {"jobs": int(n), "s": s} for name, (n, s) in sorted(by_name.items(), key=lambda kv: -kv[1][1])},
    }


def rows_only(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A churning DecodeBatch without actors: ms per step and per leave + join (see the module docstring)."""
    import mlx.core as mx
    from mlx_lm import load

    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.params import SamplingParams

    model = load(str(model_dir))[0]
    rng = random.Random(args.seed)

    def row(i: int) -> tuple[SoloRow, int]:
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(*args.prompt_tokens))]
        solo = SoloRow(model, f"r{i}", prompt, SamplingParams(max_tokens=10**6), prefill_step_size=args.prefill_step_size)
        while solo.prefill_remaining:
            solo.prefill_chunk()
        token0 = solo.first_token()
        mx.eval([c.state for c in solo.caches])
        return solo, token0

    batch = DecodeBatch(model, max_rows=args.concurrency)
    batch.join_many([row(i) for i in range(args.concurrency)])
    joiners = [row(args.concurrency + i) for i in range(args.settles)]
    for _ in range(4):  # warm-up
        batch.step_decoded()
    batch.flush_decoded()
    step_s = settle_s = 0.0
    steps = 0
    for joiner in joiners:
        start = time.perf_counter()
        for _ in range(args.steps_between):
            batch.step_decoded()
        batch.flush_decoded()
        middle = time.perf_counter()
        batch.leave([rng.choice(batch.request_ids)])
        batch.join_many([joiner])
        settle_s += time.perf_counter() - middle
        step_s += middle - start
        steps += args.steps_between
    batch.close()
    return {"rows": args.concurrency, "settles": args.settles, "steps": steps,
            "ms_per_step": 1000 * step_s / steps, "ms_per_leave_join": 1000 * settle_s / args.settles,
            "share_in_settles": settle_s / (settle_s + step_s)}


def report(result: dict[str, Any], label: str) -> None:
    print(f"# {label}")
    print(f"{result['requests']} requests, c={result['concurrency']}: {result['tokens']} tokens in "
          f"{result['wall_s']:.2f} s = {result['tok_per_s']:.0f} tok/s; lease busy {result['lease_busy_s']:.2f} s "
          f"(idle {100 * result['lease_idle_share']:.0f} % of the run)")
    print(f"chains {result['chains']} ({result['chains_per_token']:.3f} per token, "
          f"{result['steps_per_chain']:.1f} steps per chain), steps {result['steps']}")
    print("| class | jobs | s | share of busy | ms/job |")
    print("|---|---:|---:|---:|---:|")
    for cls, row in result["classes"].items():
        if row["jobs"]:
            print(f"| {cls} | {row['jobs']} | {row['s']:.3f} | {100 * row['share']:.1f} % | "
                  f"{1000 * row['s'] / row['jobs']:.2f} |")
    print("top jobs: " + ", ".join(f"{name} {row['jobs']}x {row['s']:.3f}s"
                                   for name, row in list(result["jobs"].items())[:8]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny random llama (this box, < 1 min)")
    p.add_argument("--shape", choices=list(SHAPES))
    p.add_argument("--model", help="a model directory (used when neither --tiny nor --shape)")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--batch", type=int, help="the lane's row cap (default: --concurrency)")
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--prompt-tokens", type=_range, default=(100, 1000), help="LOW-HIGH, uniform")
    p.add_argument("--output-tokens", type=_range, default=(32, 128), help="LOW-HIGH, uniform")
    p.add_argument("--stagger-s", type=float, default=1.0, help="the workers' start times spread over this")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows-only", action="store_true", help="drive a DecodeBatch directly (see above)")
    p.add_argument("--settles", type=int, default=24, help="--rows-only: membership changes timed")
    p.add_argument("--steps-between", type=int, default=2, help="--rows-only: decode steps between two")
    p.add_argument("--ab", type=int, default=0, metavar="N",
                   help="N rounds of (row slots on, row slots off), each run on a fresh engine")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    sys.setswitchinterval(0.001)  # as `mlx-trio serve`
    runs: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        shape = "tiny" if args.tiny else args.shape
        model_dir, label = resolve_model(Path(tmp), shape=shape, model=args.model, num_layers=args.num_layers)
        for _ in range(args.ab or 1):
            for slots in (("on", "off") if args.ab else ("",)):
                if slots:
                    os.environ[KILL_SWITCH] = "1" if slots == "off" else "0"  # read when each batch is made
                title = f"{label}" + (f", row slots {slots}" if slots else "")
                if args.rows_only:
                    result = rows_only(model_dir, args)
                    print(f"# {title}: {result['rows']} rows, {result['steps']} steps: "
                          f"{result['ms_per_step']:.2f} ms/step, {result['ms_per_leave_join']:.2f} ms per leave + join "
                          f"({100 * result['share_in_settles']:.1f} % of the time)")
                else:
                    result = trio.run(churn, model_dir, args)
                    report(result, title)
                runs.append((slots, result))
    if args.ab and not args.rows_only:
        print("| row slots | tok/s | step s | settle s (flush+leave+join+cache) | prefill s | chains/token |")
        print("|---|---:|---:|---:|---:|---:|")
        for slots, r in runs:
            c = r["classes"]
            settle = sum(c[k]["s"] for k in ("settle", "flush", "leave", "join", "cache"))
            print(f"| {slots} | {r['tok_per_s']:.0f} | {c['step']['s']:.3f} | {settle:.3f} | {c['prefill']['s']:.3f} | "
                  f"{r['chains_per_token']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"label": label, "runs": [{"row_slots": s, **r} for s, r in runs]},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
