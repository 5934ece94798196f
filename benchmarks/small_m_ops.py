"""What one forward's ops cost at L = 1..8 tokens: where a speculative verify forward's extra time goes.

Issue #23: on the H200 (Llama-1B shape, B=1, 2k context) a forward of L=4 tokens costs ~9 ms where
L=1 costs ~2.8 ms (benchmarks/speculative.py --phases), though the weights are read once either
way. This script times, for each L, the ops of that forward alone on random bf16 arrays of the
shape's sizes: each projection's matmul (`x @ W.T`), the tied LM head, attention of L queries
over `--context` keys (mask none / "causal" / an additive array), RoPE and RMSNorm. Each op is
evaluated `--repeats` times in one graph per timing (launch cost amortised) and also once per
evaluation (launch cost included). Prints a table of µs per op; `--tiny` runs on the CPU in
seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from mlx_trio.engine.lease_thread import chosen_backend, prepare_thread

# (hidden, intermediate, heads, kv heads, head dim, vocab): the Llama-3.2-1B shape, and a tiny one.
SHAPES = {"llama-1b": (2048, 8192, 32, 8, 64, 128256), "tiny": (64, 128, 4, 2, 16, 512)}


def _time(fn: Callable[[], mx.array], repeats: int, rounds: int = 5) -> tuple[float, float]:
    """µs per call: `repeats` calls in one evaluation, and one call per evaluation (medians of rounds)."""
    mx.eval(fn())
    batched, single = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(repeats)])
        batched.append((time.perf_counter() - start) / repeats)
        start = time.perf_counter()
        for _ in range(repeats):
            mx.eval(fn())
        single.append((time.perf_counter() - start) / repeats)
    return 1e6 * statistics.median(batched), 1e6 * statistics.median(single)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--queries", default="1,2,3,4,5,8")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if args.tiny:
        args.shape, args.repeats = "tiny", 5
    prepare_thread()
    hidden, inter, heads, kv_heads, head_dim, vocab = SHAPES[args.shape]
    dtype = mx.bfloat16
    rand = lambda *shape: (mx.random.normal(shape) * 0.02).astype(dtype)  # noqa: E731
    weights = {"q_proj": rand(heads * head_dim, hidden), "k_proj": rand(kv_heads * head_dim, hidden),
               "gate_proj": rand(inter, hidden), "down_proj": rand(hidden, inter), "lm_head": rand(vocab, hidden)}
    keys, values = rand(1, kv_heads, args.context, head_dim), rand(1, kv_heads, args.context, head_dim)
    norm_w = mx.ones((hidden,), dtype)
    mx.eval(weights, keys, values)
    print(f"shape {args.shape} | device {mx.default_device()} | attention {chosen_backend()} | "
          f"context {args.context} | µs per op: `repeats` in one eval / one per eval")
    print("| L | op | µs (batched) | µs (one per eval) | × L=1 |")
    print("|---:|---|---:|---:|---:|")
    base: dict[str, float] = {}
    for L in [int(q) for q in args.queries.split(",")]:
        x = rand(1, L, hidden)
        xi = rand(1, L, inter)
        q = rand(1, heads, L, head_dim)
        additive = mx.zeros((1, 1, L, args.context), dtype)
        ops: dict[str, Callable[[], mx.array]] = {
            **{name: (lambda w=w, name=name: (xi if name == "down_proj" else x) @ w.T) for name, w in weights.items()},
            "sdpa none": lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125),
            "sdpa causal": lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask="causal"),
            "sdpa array": lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=additive),
            "rope": lambda: mx.fast.rope(q, head_dim, traditional=False, base=500000.0, scale=1.0, offset=args.context),
            "rms_norm": lambda: mx.fast.rms_norm(x, norm_w, 1e-5),
        }
        for name, fn in ops.items():
            batched, single = _time(fn, args.repeats)
            base.setdefault(name, batched)
            print(f"| {L} | {name} | {batched:.1f} | {single:.1f} | {batched / base[name]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
