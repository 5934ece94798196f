"""Does a prefill chunk at a context length never seen before cost more on this backend? (issue #19/#20 experiment)

Usage: python benchmarks/prefill_shapes.py --shape llama-1b

Times (a) a whole-model chunk of `--chunk` tokens after contexts that are new each time, then the same
contexts again; (b) `mx.fast.scaled_dot_product_attention` alone at those shapes, with the "causal"
mask mlx-lm passes and with an explicit boolean mask; (c) chunk lengths that are new at one context.
If the first visit of a shape is much dearer than the second, kernels are specialised (JIT-compiled
or planned) per shape, and every chunk of a real prompt pays that, since its context is new.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.testing.shaped_models import resolve_model


def ms(fn) -> float:
    mx.synchronize()
    t = time.perf_counter()
    fn()
    mx.synchronize()
    return round((time.perf_counter() - t) * 1e3, 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-1b")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--chunk", type=int, default=512)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = resolve_model(Path(tmp), shape=args.shape, model=None, num_layers=args.num_layers)
        model, _ = load(str(path))
    vocab, n = model.args.vocab_size, args.chunk
    contexts = [6000 + 97 * i for i in range(6)]

    def chunk_after(context: int, size: int = n) -> float:
        cache = make_prompt_cache(model)
        prefix = mx.random.randint(0, vocab, (1, context))
        for i in range(0, context, 2048):
            model(prefix[:, i:i + 2048], cache=cache)
            mx.eval([c.state for c in cache])
        chunk = mx.random.randint(0, vocab, (1, size))

        def run() -> None:
            model(chunk, cache=cache)
            mx.eval([c.state for c in cache])
        return ms(run)

    print("model chunk, new contexts:   ", [chunk_after(c) for c in contexts], flush=True)
    print("model chunk, same again:     ", [chunk_after(c) for c in contexts], flush=True)
    print("model chunk, new sizes at 6000:", [chunk_after(6000, s) for s in (480, 544, 608, 672)], flush=True)
    print("model chunk, same sizes again:  ", [chunk_after(6000, s) for s in (480, 544, 608, 672)], flush=True)
    heads, kv_heads, dim = model.args.num_attention_heads, model.args.num_key_value_heads, 64
    q = mx.random.normal((1, heads, n, dim)).astype(mx.bfloat16)
    for label, masked in (("causal", False), ("bool mask", True)):
        for visit in ("new", "again"):
            times = []
            for c in ([7000 + 89 * i for i in range(5)] if not masked else [7001 + 89 * i for i in range(5)]):
                k = mx.random.normal((1, kv_heads, c + n, dim)).astype(mx.bfloat16)
                v = mx.random.normal((1, kv_heads, c + n, dim)).astype(mx.bfloat16)
                mask = (mx.arange(c + n)[None] <= (mx.arange(n)[:, None] + c)) if masked else "causal"
                mx.eval(k, v, *( [mask] if masked else []))
                times.append(ms(lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))))
            print(f"sdpa alone ({label}), {visit}:", times, flush=True)


if __name__ == "__main__":
    main()
