"""What a speculative verify forward costs on this device: key lengths never seen vs seen vs on a grid.

Issue #23: on the H200 a verified step (L = K+1 = 4 queries) cost ~50 ms at B=1 against 3.6 ms
for a plain step (docs/benchmarks.md, "Speculative decoding"). The suspect is MLX's per-shape
cost: every verify forward attends over a key length the process has not seen. This script
times one model forward of L tokens over a P-token cache, B rows, in four ways:

* `new`: after each forward the cache is trimmed by L-1, so the next forward's key length is
  one longer (an accepted proposal of 0 tokens plus the bonus token: every shape is new);
* `seen`: trimmed by L, so every forward has the same shape;
* `grid`: as `new`, but attention reads the key buffer up to the next multiple of `--grid`
  with a causal array mask (the buffer's tail is past every query's position, so it is masked
  out): the shape changes only once per `--grid` tokens;
* `new, causal str`: as `new` with the default mask (what mlx-lm builds for L > 1).

Prints a table of median ms per forward. `--tiny` runs on this CPU in seconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import KVCache

from mlx_trio.engine.lease_thread import prepare_thread
from mlx_trio.testing.shaped_models import resolve_model


class GridKVCache(KVCache):
    """A KVCache whose attention reads the buffer up to the next multiple of `grid`, masked causally.

    `grid` divides KVCache.step (256), so the buffer always reaches that multiple.
    """

    def __init__(self, grid: int) -> None:
        super().__init__()
        assert self.step % grid == 0
        self.grid = grid

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        super().update_and_fetch(keys, values)
        end = -(-self.offset // self.grid) * self.grid
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        # Keys past a query's own position are masked: the buffer's tail up to the grid point too.
        end = -(-(self.offset + N) // self.grid) * self.grid
        return mx.arange(self.offset, self.offset + N)[:, None] >= mx.arange(end)[None]


def run(model: Any, prompt: mx.array, batch: int, queries: int, variant: str, forwards: int,
        grid: int) -> float:
    caches = [GridKVCache(grid) if variant == "grid" else KVCache() for _ in model.layers]
    mx.eval(model(mx.repeat(prompt[None], batch, axis=0), cache=caches))
    tokens = mx.repeat(prompt[None, :queries], batch, axis=0)
    trim = queries if variant == "seen" else queries - 1
    times = []
    for i in range(forwards + 5):
        start = time.perf_counter()
        mx.eval(model(tokens, cache=caches))
        if i >= 5:
            times.append((time.perf_counter() - start) * 1000)
        for c in caches:
            c.trim(trim)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-1b", help='a shape of mlx_trio.testing.shaped_models, or "tiny"')
    parser.add_argument("--model", help="a model directory instead of a shape")
    parser.add_argument("--tiny", action="store_true", help="the tiny model, few forwards (this CPU)")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--queries", default="1,4")
    parser.add_argument("--forwards", type=int, default=40)
    parser.add_argument("--grid", type=int, default=64)
    args = parser.parse_args()
    if args.tiny:
        args.shape, args.forwards, args.prompt_tokens = "tiny", 8, 300
    prepare_thread()  # the engine's attention settings (MLX's own kernels on CUDA, not cuDNN)
    with tempfile.TemporaryDirectory() as tmp:
        path, label = resolve_model(Path(tmp), shape=None if args.model else args.shape, model=args.model,
                                    num_layers=None)
        model, _ = load(str(path))
    print(f"{label}, {args.prompt_tokens}-token cache, {mx.default_device()}, median of {args.forwards} forwards")
    prompt = mx.random.randint(3, 500, (args.prompt_tokens,), key=mx.random.key(0))
    print(f"| B | L | new ms | seen ms | grid ({args.grid}) ms | new/seen | grid/seen |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in [int(b) for b in args.batches.split(",")]:
        for queries in [int(q) for q in args.queries.split(",")]:
            ms = {v: run(model, prompt, batch, queries, v, args.forwards, args.grid) for v in ("new", "seen", "grid")}
            print(f"| {batch} | {queries} | {ms['new']:.2f} | {ms['seen']:.2f} | {ms['grid']:.2f} | "
                  f"{ms['new'] / ms['seen']:.2f} | {ms['grid'] / ms['seen']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
