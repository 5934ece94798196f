"""How fast MLX's matmul reads a decode step's weights, and the bound that puts on a step (issue #25).

Usage (MLX's CUDA backend):
    python benchmarks/projection_bandwidth.py                    # Llama-1B and -8B shapes, rows 1, 2 and 8
    python benchmarks/projection_bandwidth.py --shapes 8b --rows 1 --json out.json

A decode step of a few rows is a chain of matrix-vector products: each weight
is read once a step, so its device time is the weights' bytes over the rate
the kernels read them at. For each projection (`x [M, K] @ w.T`, `w [N, K]`
bf16 as `nn.Linear` stores it; q/k/v and gate/up fused, as the engine loads a
Llama) this times a graph of `--calls` products, each over another copy of the
weight (at least `--min-bytes` of copies, so no read is served from L2),
evaluated at once: GB/s of weights read (the H200's HBM: 4.8 TB/s nominal).
Then **a whole step's projections**: every layer's four and the LM head, each
layer its own weights, `x` carried through (slices, a product and the
residual adds between them), as one graph: the steps a second that the
projections alone allow at this many rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

# layers, (name, K, N) per projection, and the LM head: Llama-3.2-1B and Llama-3.1-8B, q/k/v and gate/up fused.
SHAPES = {
    "1b": (16, [("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048)],
           ("lm_head", 2048, 128256)),
    "8b": (32, [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
           ("lm_head", 4096, 128256)),
}


def _weight(K: int, N: int, seed: int) -> mx.array:
    return (mx.random.normal((N, K), key=mx.random.key(seed)) * K**-0.5).astype(mx.bfloat16)


def _median_s(run: Any, repeats: int) -> float:
    """Median wall seconds of `run()` (which evaluates its graph) over `repeats`, after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def projection_s(K: int, N: int, rows: int, calls: int, min_bytes: int, repeats: int) -> float:
    """Seconds per product, over `calls` products of distinct weight copies in one graph."""
    copies = max(2, -(-min_bytes // (2 * K * N)))
    weights = [_weight(K, N, i) for i in range(copies)]
    x = mx.random.normal((rows, K), key=mx.random.key(99)).astype(mx.bfloat16)
    mx.eval(weights, x)
    seconds = _median_s(lambda: mx.eval([x @ weights[i % copies].T for i in range(calls)]), repeats) / calls
    del weights
    mx.clear_cache()
    return seconds


def step_s(model: dict[str, Any], rows: int, repeats: int) -> float:
    """Seconds for one step's projections: each layer's four in order (x carried through), then the LM head."""
    def run() -> None:
        h = model["x"][:rows]
        for layer in model["layers"]:
            q = h @ layer["qkv"].T
            h = h + q[:, : h.shape[1]] @ layer["o"].T
            g = h @ layer["gate_up"].T
            half = g.shape[1] // 2
            h = h + (g[:, :half] * g[:, half:]) @ layer["down"].T
        mx.eval(h @ model["lm_head"].T)

    return _median_s(run, repeats)


def _model(shape: str) -> dict[str, Any]:
    num_layers, projections, (_, K, N) = SHAPES[shape]
    layers = []
    for i in range(num_layers):
        layers.append({name: _weight(k, n, 1000 * i + j) for j, (name, k, n) in enumerate(projections)})
        mx.eval(layers[-1])
    model = {"layers": layers, "lm_head": _weight(K, N, 7),
             "x": mx.random.normal((8, projections[0][1]), key=mx.random.key(8)).astype(mx.bfloat16)}
    mx.eval(model["lm_head"], model["x"])
    return model


def weight_bytes(shape: str) -> int:
    num_layers, projections, (_, K, N) = SHAPES[shape]
    return 2 * (num_layers * sum(k * n for _, k, n in projections) + K * N)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1b,8b")
    p.add_argument("--rows", default="1,2,8")
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--min-bytes", type=int, default=256 << 20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not mx.cuda.is_available():
        print("projection_bandwidth.py measures MLX's CUDA backend")
        return 1
    rows_list = [int(r) for r in args.rows.split(",")]
    out: dict[str, Any] = {"projections": [], "steps": []}
    for shape in args.shapes.split(","):
        _, projections, head = SHAPES[shape]
        for name, K, N in [*projections, head]:
            for rows in rows_list:
                seconds = projection_s(K, N, rows, args.calls, args.min_bytes, args.repeats)
                print(f"{shape} {name:8s} K={K:6d} N={N:6d} M={rows}: {seconds * 1e6:7.1f} us, "
                      f"{2 * K * N / seconds / 1e9:5.0f} GB/s", flush=True)
                out["projections"].append({"shape": shape, "name": name, "K": K, "N": N, "rows": rows, "s": seconds})
        model = _model(shape)
        for rows in rows_list:
            seconds = step_s(model, rows, args.repeats)
            print(f"{shape} step projections M={rows}: {seconds * 1e3:.2f} ms, "
                  f"{weight_bytes(shape) / seconds / 1e9:.0f} GB/s, at most {1 / seconds:.0f} steps/s", flush=True)
            out["steps"].append({"shape": shape, "rows": rows, "s": seconds, "weight_bytes": weight_bytes(shape)})
        del model
        mx.clear_cache()
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
