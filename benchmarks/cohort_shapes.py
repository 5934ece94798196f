"""What one cohort prefill job costs by rows, at cohort shapes never seen before and seen again (issue #20).

Usage:
    python benchmarks/cohort_shapes.py --tiny                                     # this CPU, < 1 min
    python benchmarks/cohort_shapes.py --model /tmp/mlx-trio-gpu-models/llama-1b   # the H200
    MLX_USE_CUDA_GRAPHS=0 python benchmarks/cohort_shapes.py --model ...           # kernels launched one by one

A serving burst of short prompts (c=64, ~47-token prompts) prefilled in ~62 jobs
of about two rows each at ~29 ms a job on the H200 (docs/lab-notes/2026-12-01-h200-pass14.md), where one batched forward of 32 such rows is a few ms of
device work. This script times `prefill_rows` (engine/batch/cohort_prefill.py:
make the rows, prefill them, sample token 0) as the prefill actor's lease job
runs it, under prefill-only cuDNN's layout on CUDA (the cohort's attention on
MLX's plain ops), for cohorts of `--rows` rows of random `--min-len`..`--max-len`
token prompts:

* **new**: every job's padded shape (rows x longest prompt) is one this
  process has not run before;
* **seen**: the last new job's exact prompts' lengths again (its shape seen).

If "new" costs much more than "seen", a cohort pays per shape (CUDA-graph
instantiation, kernel selection or compilation), and bucketing the cohort's
shapes would pay it once per bucket. Milliseconds per job (median of
`--repeats`), and per row.

`--parts` times a shared cohort's parts one by one instead, the device
synchronised after each (`parts_ms`, the steps of `prefill_together` with a
wait between them): making the rows, the merge, the forwards, the roll of the
right padding (`finalize`), token 0's L=1 step, a second L=1 step on the same
caches (one-off costs show as the first step's excess over it), the argmax and
the hand-back. Medians of `--repeats` jobs at new and at seen shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import KVCache

from mlx_trio.engine.attention import routed_attention
from mlx_trio.engine.batch import cohort_prefill
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.kv import decode_layout
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

GREEDY = SamplingParams(max_tokens=8)


def _job_ms(model: object, lengths: Sequence[int], salt: int) -> float:
    """One `prefill_rows` job of prompts of `lengths` tokens, device work included (ms)."""
    rng = random.Random(salt)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]
    makers: list[Callable[[], SoloRow]] = [
        lambda i=i, p=p: SoloRow(model, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    mx.synchronize()
    start = time.perf_counter()
    rows = cohort_prefill.prefill_rows(model, makers)  # type: ignore[arg-type]
    mx.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    for row in rows:
        if isinstance(row, Exception):
            raise row
        row.close()
    return ms


def parts_ms(model: object, lengths: Sequence[int], salt: int) -> dict[str, float]:
    """One shared cohort of prompts of `lengths` tokens, part by part, the device synchronised after each (ms).

    The steps of `cohort_prefill.prefill_together` in its order, for plain greedy rows; a diagnostic mirror,
    so every part's device time lands in its own number.
    """
    rng = random.Random(salt)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]
    out: dict[str, float] = {}
    clock = [time.perf_counter()]

    def mark(name: str, *arrays: object) -> None:
        mx.eval(*arrays)
        mx.synchronize()
        now = time.perf_counter()
        out[name] = out.get(name, 0.0) + (now - clock[0]) * 1e3
        clock[0] = now

    mx.synchronize()
    clock[0] = time.perf_counter()
    rows = [SoloRow(model, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]  # type: ignore[arg-type]
    mark("make")
    remaining = [row.prefill_remaining for row in rows]
    batch, longest = cohort_prefill.cohort_shape(len(rows), max(remaining))
    spare = batch - len(rows)
    caches = cohort_prefill._merge([*(row.caches for row in rows),
                                    *([KVCache() for _ in rows[0].caches] for _ in range(spare))])
    mark("merge", [c.state for c in caches if c.keys is not None])
    lengths_b = remaining + [0] * spare
    taken = [row.take_prefill(n) if n else None for row, n in zip(rows, lengths_b)]
    inputs = mx.stack([cohort_prefill._right_padded(t, longest) for t in [*taken, *([None] * spare)]])
    for layer in caches:
        layer.prepare(lengths=lengths_b, right_padding=[longest - n for n in lengths_b])
    step = cohort_prefill.COHORT_CUDNN_COLUMNS
    for start in range(0, longest, step):
        model(inputs[:, start : start + step], cache=caches)  # type: ignore[operator]
        mark("forward", [c.state for c in caches])
    for layer in caches:
        layer.finalize()
    mark("finalize", [c.state for c in caches])
    lasts = [row.last_input() for row in rows]
    decode_layout.keep_vector_decode(caches)
    feed = mx.stack([*lasts, *(cohort_prefill._right_padded(None, 1) for _ in range(spare))])
    logits = model(feed, cache=caches)[:, -1, :]  # type: ignore[operator]
    mark("token0 build")
    mark("token0 step", logits, [c.state for c in caches])
    picked = mx.argmax(logits, axis=-1)
    mark("argmax", picked)
    decode_layout.keep_vector_decode(caches)
    again = model(picked[:, None].astype(mx.int32), cache=caches)[:, -1, :]  # type: ignore[operator]
    mark("second step", again, [c.state for c in caches])
    cohort_prefill._hand_back(rows, caches, range(len(rows)))
    mark("hand_back")  # as the server hands back: the rows join from the block, their own slices never cut
    for row in rows:
        row.close()
    return out


def measure_parts(model: object, rows: int, args: argparse.Namespace, rng: random.Random) -> dict:
    """`args.repeats` part-by-part jobs at new prompt lengths, then as many at the last one's lengths (medians)."""
    def median(jobs: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(j[k] for j in jobs) for k in jobs[0]}

    new, lengths = [], []
    for k in range(args.repeats):
        lengths = [rng.randint(args.min_len, args.max_len) for _ in range(rows)]
        new.append(parts_ms(model, lengths, salt=rows * 1000 + k))
    seen = [parts_ms(model, lengths, salt=rows * 1000 + 500 + k) for k in range(args.repeats)]
    return {"rows": rows, "new": median(new), "seen": median(seen)}


def measure(model: object, rows: int, args: argparse.Namespace, rng: random.Random, seen_longest: set[tuple[int, int]]) -> dict:
    """`args.repeats` jobs at new shapes, then as many at the last one's shape."""
    new: list[float] = []
    lengths: list[int] = []
    for k in range(args.repeats):
        # A longest prompt this process has not run at this row count: a new padded shape.
        free = [n for n in range(args.min_len, args.max_len + 1) if (rows, n) not in seen_longest]
        longest = rng.choice(free) if free else args.max_len
        seen_longest.add((rows, longest))
        lengths = [rng.randint(args.min_len, longest) for _ in range(rows - 1)] + [longest]
        new.append(_job_ms(model, lengths, salt=rows * 1000 + k))
    seen = [_job_ms(model, lengths, salt=rows * 1000 + 500 + k) for k in range(args.repeats)]
    return {"rows": rows, "new_ms": statistics.median(new), "seen_ms": statistics.median(seen),
            "new_all": new, "seen_all": seen}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny random llama on this CPU")
    p.add_argument("--model", default=None, help="a model directory")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="cohort sizes")
    p.add_argument("--min-len", type=int, default=40)
    p.add_argument("--max-len", type=int, default=56)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="jobs run first (not measured)")
    p.add_argument("--parts", action="store_true", help="time a shared cohort's parts one by one (`parts_ms`)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    path = str(tiny_model(LLAMA)) if args.tiny or args.model is None else args.model
    model = load(path)[0]
    routed_attention.install(model)
    cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    decode_layout.set_active(cuda)  # prefill-only cuDNN's layout, as the lease thread sets it on CUDA
    graphs = os.environ.get("MLX_USE_CUDA_GRAPHS", "1")
    print(f"# cohort shapes: {path}; CUDA {cuda}, MLX_USE_CUDA_GRAPHS={graphs}; prompts {args.min_len}-"
          f"{args.max_len} tokens, {args.repeats} jobs a cell", flush=True)
    sizes = [int(x) for x in args.rows.split(",")]
    for _ in range(args.warmup):
        _job_ms(model, [args.min_len] * 2, salt=7)
    if args.parts:
        rng = random.Random(0)
        parts = [measure_parts(model, rows, args, rng) for rows in sizes if rows > 1]
        for r in parts:
            for kind in ("new", "seen"):
                print(f"  parts rows={r['rows']:3d} {kind}: " + ", ".join(f"{k} {v:.1f}" for k, v in r[kind].items())
                      + f" (ms; total {sum(r[kind].values()):.1f})", flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "parts": parts}, indent=1))
        return
    results = []
    rng = random.Random(0)
    seen: set[tuple[int, int]] = set()
    for rows in sizes:
        r = measure(model, rows, args, rng, seen) | {"mode": "shared"}
        results.append(r)
        print(f"  shared rows={rows:3d}: new {r['new_ms']:7.1f} ms, seen {r['seen_ms']:7.1f} ms", flush=True)
    print("\n| mode | rows | ms a job, new shape | seen shape | new / seen | ms a row (seen) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['mode']} | {r['rows']} | {r['new_ms']:.1f} | {r['seen_ms']:.1f} | "
              f"{r['new_ms'] / max(r['seen_ms'], 1e-9):.2f} | {r['seen_ms'] / r['rows']:.1f} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
