"""Where a long prompt's prefill time goes: per-chunk wall time of our solo prefill vs mlx-lm's.

Usage (H200, see benchmarks/gpu.sh for staging):
    python benchmarks/prefill_profile.py --shape llama-1b --prompt-tokens 8500 --chunks 512,2048

For each chunk size: our `SoloRow.prefill_chunk` (mx.eval of the cache state and
`mx.clear_cache()` per chunk, as mlx-lm's generate_step), the same without
`clear_cache`, and mlx-lm's `generate_step` prefill (time to its first token).
Prints milliseconds per chunk (median, max) and the whole prefill.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.params import SamplingParams
from mlx_trio.testing.shaped_models import build_shape


def ours(model, prompt: list[int], chunk: int, clear: bool) -> tuple[list[float], float]:
    row = SoloRow(model, "p", prompt, SamplingParams(max_tokens=1), prefill_step_size=chunk)
    times = []
    start = time.perf_counter()
    real_clear = mx.clear_cache
    if not clear:
        mx.clear_cache = lambda: None  # a profiling seam only: measure the allocator's share
    try:
        while row.prefill_remaining:
            t = time.perf_counter()
            row.prefill_chunk()
            times.append(time.perf_counter() - t)
        row.first_token()
    finally:
        mx.clear_cache = real_clear
    total = time.perf_counter() - start
    row.close()
    return times, total


def theirs(model, prompt: list[int], chunk: int) -> float:
    start = time.perf_counter()
    for _ in generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=chunk):
        break
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-1b")
    p.add_argument("--prompt-tokens", type=int, default=8500)
    p.add_argument("--chunks", default="512,2048")
    args = p.parse_args()
    model_dir = build_shape(args.shape, Path(tempfile.mkdtemp()), None)
    model, _ = load(str(model_dir))
    mx.eval(model.parameters())
    prompt = [(7 * j) % 500 + 10 for j in range(args.prompt_tokens)]
    print(f"{args.shape}, {args.prompt_tokens}-token prompt, device {mx.default_device()}")
    for chunk in [int(c) for c in args.chunks.split(",")]:
        ours(model, prompt, chunk, True)  # warm-up
        for clear in (True, False):
            times, total = ours(model, prompt, chunk, clear)
            print(f"chunk {chunk:5d} ours clear_cache={clear!s:5}: {len(times)} chunks, median "
                  f"{statistics.median(times) * 1e3:7.1f} ms, max {max(times) * 1e3:7.1f} ms, total {total * 1e3:7.1f} ms")
        theirs(model, prompt, chunk)
        print(f"chunk {chunk:5d} mlx-lm generate_step prefill total {theirs(model, prompt, chunk) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
