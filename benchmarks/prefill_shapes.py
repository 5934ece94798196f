"""Does a prefill chunk at a context length never seen before cost more on this backend? (issue #19/#20 experiment)

Usage: python benchmarks/prefill_shapes.py --shape llama-1b          (or --model DIR; --tiny on a CPU)
       MLX_CUDA_USE_CUDNN_SDPA=0 python benchmarks/prefill_shapes.py ...   (MLX's own attention kernels)

The attention kernels are MLX's choice for this process: cuDNN unless `MLX_CUDA_USE_CUDNN_SDPA=0`
(MLX reads it once per process, so compare two processes). Times
(a) a whole-model chunk of `--chunk` tokens after contexts that are new each time, then the same
contexts again, off the shape grid and on it (contexts and chunk multiples of 256, as the engine's
grid makes them: engine/batch/chunked_prefill.py); (b) `mx.fast.scaled_dot_product_attention` alone
at those shapes, with the "causal" mask mlx-lm passes and with an explicit boolean mask; (c) chunk
lengths that are new at one context; (d) a lone row's decode steps (B=1, L=1) at new contexts, on
mlx-lm's buffers (a multiple of 256 slots: cuDNN's decode path when cuDNN is on) and with the
engine's decode layout (engine/kv/decode_layout.py: 8 slots more, so MLX runs its vector kernel):
the first step at each context (a cuDNN plan is built there) and the median of the rest.
If the first visit of a shape is much dearer than the second, kernels are specialised (JIT-compiled
or planned) per shape, and every chunk of a real prompt pays that, unless the grid repeats it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.kv import decode_layout
from mlx_trio.testing.shaped_models import SHAPES, resolve_model


def ms(fn: Callable[[], object]) -> float:
    mx.synchronize()
    t = time.perf_counter()
    fn()
    mx.synchronize()
    return round((time.perf_counter() - t) * 1e3, 1)


def attention_label() -> str:
    """MLX's attention kernels in this process, as its variable sets them (cuDNN when unset, on CUDA)."""
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        return "MLX's kernels (not CUDA)"
    return "MLX's own kernels" if os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1").strip() == "0" else "cuDNN"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="llama-1b")
    p.add_argument("--model", help="a model directory (wins over --shape), e.g. gpu.sh's built shape")
    p.add_argument("--tiny", action="store_true", help="the tiny model at small contexts: a CPU check in < 1 min")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--context", type=int, default=6000, help="about where the measured chunks start")
    p.add_argument("--decode-steps", type=int, default=12)
    p.add_argument("--json", type=Path, help="write every measurement here")
    args = p.parse_args()
    if args.tiny:
        args.shape, args.context, args.chunk, args.decode_steps = "tiny", 600, 128, 6
    with tempfile.TemporaryDirectory() as tmp:
        path, label = resolve_model(Path(tmp), shape=None if args.model else args.shape, model=args.model,
                                    num_layers=args.num_layers)
        model, _ = load(str(path))
    vocab, n, base = model.args.vocab_size, args.chunk, args.context
    results: dict[str, Any] = {"model": label, "attention": attention_label(), "chunk": n}
    print(f"# {label}; attention: {results['attention']}", flush=True)

    def record(name: str, values: Any) -> None:
        results[name] = values
        print(f"{name + ':':<48}", values, flush=True)

    def filled(context: int) -> list[Any]:
        """A fresh cache holding `context` random tokens, prefilled in grid-like 2048-token chunks."""
        cache = make_prompt_cache(model)
        prefix = mx.random.randint(0, vocab, (1, context))
        for i in range(0, context, 2048):
            model(prefix[:, i:i + 2048], cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    def chunk_after(context: int, size: int = n) -> float:
        cache = filled(context)
        chunk = mx.random.randint(0, vocab, (1, size))

        def run() -> None:
            model(chunk, cache=cache)
            mx.eval([c.state for c in cache])
        return ms(run)

    off_grid = [base + 97 * i for i in range(6)]
    grid = 256
    on_grid = [(base // grid + i) * grid for i in range(6)]
    record("model chunk, new contexts", [chunk_after(c) for c in off_grid])
    record("model chunk, same again", [chunk_after(c) for c in off_grid])
    record("model chunk on the grid, new contexts", [chunk_after(c) for c in on_grid])
    record("model chunk on the grid, same again", [chunk_after(c) for c in on_grid])
    sizes = [n - 32, n + 32, n + 96, n + 160]
    record(f"model chunk, new sizes at {base}", [chunk_after(base, s) for s in sizes])
    record("model chunk, same sizes again", [chunk_after(base, s) for s in sizes])
    heads, kv_heads, dim = model.args.num_attention_heads, model.args.num_key_value_heads, 64
    q = mx.random.normal((1, heads, n, dim)).astype(mx.bfloat16)
    for mask_label, masked in (("causal", False), ("bool mask", True)):
        for visit in ("new", "again"):
            times = []
            for c in [base + 1000 + 89 * i + masked for i in range(5)]:
                k = mx.random.normal((1, kv_heads, c + n, dim)).astype(mx.bfloat16)
                v = mx.random.normal((1, kv_heads, c + n, dim)).astype(mx.bfloat16)
                mask = (mx.arange(c + n)[None] <= (mx.arange(n)[:, None] + c)) if masked else "causal"
                mx.eval(k, v, *([mask] if masked else []))
                times.append(ms(lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))))
            record(f"sdpa alone ({mask_label}), {visit}", times)

    def decode_at(context: int, layout: bool) -> tuple[float, float]:
        """(first step ms, median of the rest) of a lone row's decode after `context` tokens."""
        cache = filled(context)
        token = mx.array([[5]])
        decode_layout.set_active(layout)
        times = []
        try:
            for _ in range(args.decode_steps):
                def step() -> None:
                    decode_layout.keep_vector_decode(cache)
                    mx.eval(model(token, cache=cache), [c.state for c in cache])
                times.append(ms(step))
        finally:
            decode_layout.set_active(False)
        return times[0], round(statistics.median(times[1:]), 2)

    # Contexts with slack in their last 256-slot step, new each time (cuDNN plans decode per buffer length).
    contexts = [(base // grid + 8 + 2 * i) * grid + 100 for i in range(4)]
    for layout, name in ((False, "mlx-lm's buffers"), (True, "decode layout")):
        pairs = [decode_at(c, layout) for c in contexts]
        record(f"decode B=1, {name}: first step ms", [a for a, _ in pairs])
        record(f"decode B=1, {name}: median step ms", [b for _, b in pairs])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
