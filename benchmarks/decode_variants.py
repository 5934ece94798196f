"""Where a batched decode step's host time goes: the same pipelined loop over different caches and samplers.

Usage:
    python benchmarks/decode_variants.py --shape llama-1b --batches 1,4,16,64
    python benchmarks/decode_variants.py --shape tiny --batches 4 --steps 32     # a CPU shape check

Every variant is the bare loop of benchmarks/batch_throughput.py (forward + argmax,
``async_eval`` one step ahead, ``tolist`` of the previous step) on B equal
prompts, differing in one thing:

* ``kvcache``    mlx-lm ``KVCache`` with B rows: no padding, no mask at L=1;
* ``batchkv``    mlx-lm ``BatchKVCache`` without padding: an all-true array mask every step
                 (batch_throughput.py's ``bare`` at B>1, and mlx-lm's BatchGenerator);
* ``hostpadded`` our ``HostPaddedBatchKVCache`` without padding: no mask (engine/kv/batch_kv.py);
* ``padded``     ``HostPaddedBatchKVCache`` with row 0 one token shorter: a mask it needs;
* ``lse``        ``hostpadded`` with ``logsumexp`` before the argmax (the engine's greedy path);
* ``direct``     the engine's ``DecodeBatch`` (rows prefilled alone, joined together), ``step()``;
* ``report``     ``direct`` through ``steps_decoded(1, report)``: tokens read before the launch;
* ``chain``      ``report`` as the engine runs it: a `GpuLease` chain of one-step jobs in a Trio
                 run, each report handed to Trio (`to_trio_soon`) and dropped there;
* ``chain+trio`` ``chain`` with ``--trio-us`` of pure-Python work on the Trio thread per report
                 (what emitting, the session and the caller cost there), competing for the GIL.

Variants run in turn, ``--repeats`` rounds (host speed drifts: a round sees
them all alike); the table shows medians of ms per step over the steps after
the first eight, and for the loops the host split (graph build, ``async_eval``,
waiting for the device).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")  # as the engine's lease thread (engine/lease_thread.py)

from mlx_trio.testing.shaped_models import (  # noqa: E402  (after the environment variable)
    SHAPES,
    build_shape,
    run_in_mlx_thread,
    tiny_tokenizer_dir,
)

VARIANTS = ("kvcache", "batchkv", "hostpadded", "padded", "lse", "direct", "report", "chain", "chain+trio")
SKIP = 8  # steps not timed: buffer growth and first-use kernels


def loop(model: Any, prompts: list[list[int]], steps: int, variant: str) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from mlx_trio.engine.kv.batch_kv import HostPaddedBatchKVCache

    B = len(prompts)
    if variant == "kvcache":
        cache = make_prompt_cache(model)
    elif variant == "batchkv":
        cache = [BatchKVCache([0] * B) for _ in model.layers]
    elif variant == "padded":
        cache = [HostPaddedBatchKVCache([1] + [0] * (B - 1)) for _ in model.layers]
        prompts = [[0, *prompts[0][1:]], *prompts[1:]]  # row 0: one pad token, masked
    else:
        cache = [HostPaddedBatchKVCache([0] * B) for _ in model.layers]
    x = mx.array(prompts, dtype=mx.int32)
    model(x[:, :-1], cache=cache)
    mx.eval([c.state for c in cache])

    def pick(logits: mx.array) -> mx.array:
        if variant == "lse":
            logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(logits, axis=-1)

    y = pick(model(x[:, -1:], cache=cache)[:, -1, :])
    mx.async_eval(y)
    build = launch = wait = 0.0
    clock = StepClock(steps)
    for i in range(steps):
        clock.tick(i)
        if i == SKIP:
            build, launch, wait = 0.0, 0.0, 0.0
        a = time.perf_counter()
        nxt = pick(model(y[:, None], cache=cache)[:, -1, :])
        b = time.perf_counter()
        mx.async_eval(nxt)
        c = time.perf_counter()
        y.tolist()
        build, launch, wait = build + b - a, launch + c - b, wait + time.perf_counter() - c
        y = nxt
    clock.tick(steps)
    n = steps - SKIP
    out = clock.result | {"build": 1e3 * build / n, "launch": 1e3 * launch / n, "wait": 1e3 * wait / n}
    del cache, y, nxt
    mx.clear_cache()
    return out


def joined_batch(model: Any, prompts: list[list[int]], steps: int) -> Any:
    """The engine's `DecodeBatch` with every prompt prefilled alone and joined, ready to step."""
    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow
    from mlx_trio.params import SamplingParams

    params = SamplingParams(max_tokens=steps + 1)
    rows = []
    for i, ids in enumerate(prompts):
        row = SoloRow(model, f"v{i}", ids, params)
        while row.prefill_remaining:
            row.prefill_chunk()
        rows.append((row, row.first_token()))
    batch = DecodeBatch(model)
    batch.join_many(rows)
    return batch


class StepClock:
    """Wall and thread-CPU time of steps SKIP.. of a loop, per step, in ms."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.t0 = self.cpu0 = 0.0
        self.result: dict[str, float] = {}

    def tick(self, i: int) -> None:
        """Call before step i (and once more with i == steps, after the last)."""
        if i == SKIP:
            self.t0, self.cpu0 = time.perf_counter(), time.thread_time()
        elif i == self.steps:
            n = self.steps - SKIP
            self.result = {"ms": 1e3 * (time.perf_counter() - self.t0) / n,
                           "cpu": 1e3 * (time.thread_time() - self.cpu0) / n}


def direct(model: Any, prompts: list[list[int]], steps: int, variant: str) -> dict[str, float]:
    import mlx.core as mx

    batch = joined_batch(model, prompts, steps)
    clock = StepClock(steps)
    for i in range(steps):
        clock.tick(i)
        if variant == "report":
            batch.steps_decoded(1, lambda decoded: None)
        else:
            batch.step_decoded()
    clock.tick(steps)
    batch.close()
    mx.clear_cache()
    return clock.result


def chained(model: Any, prompts: list[list[int]], steps: int, trio_us: float) -> dict[str, float]:
    """`direct` with reports, as one-step jobs of a lease chain; each report costs `trio_us` on the Trio thread."""
    import trio

    from mlx_trio.actors.gpu_lease import open_gpu_lease
    from mlx_trio.engine.lease_thread import prepare_thread, release_thread_streams

    def on_trio() -> None:
        until = time.perf_counter() + trio_us * 1e-6
        while time.perf_counter() < until:
            pass

    async def main() -> dict[str, float]:
        async with open_gpu_lease(on_thread_start=prepare_thread, on_thread_exit=release_thread_streams) as lease:
            batch = await lease.run(joined_batch, model, prompts, steps)
            clock = StepClock(steps)
            count = iter(range(steps + 1))

            def report(decoded: Any) -> None:
                lease.to_trio_soon(on_trio)

            def link() -> bool:
                i = next(count)
                clock.tick(i)
                if i == steps:
                    return False
                batch.steps_decoded(1, report)
                return True

            await lease.chain(link).wait()
            await lease.run(batch.close)
        return clock.result

    return trio.run(main)


def variant_fn(model: Any, prompts: list[list[int]], steps: int, variant: str, trio_us: float) -> dict[str, float]:
    if variant in ("direct", "report"):
        return direct(model, prompts, steps, variant)
    if variant.startswith("chain"):
        return chained(model, prompts, steps, trio_us if variant == "chain+trio" else 0.0)
    return loop(model, prompts, steps, variant)


def run(model_dir: Path, batches: Sequence[int], steps: int, prompt_tokens: int, repeats: int,
        trio_us: float) -> None:
    import mlx.core as mx
    from mlx_lm import load

    model = load(str(model_dir))[0]
    mx.eval(model.parameters())
    vocab = model.args.vocab_size
    print(f"# device {mx.default_device()}; prompt {prompt_tokens}, {steps} steps ({SKIP} untimed), "
          f"median of {repeats} rounds", flush=True)
    print("| B | variant | ms/step | thread CPU ms | build | async_eval | wait | vs batchkv |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for B in batches:
        prompts = [[(97 * r + 31 * j) % (vocab - 3) + 3 for j in range(prompt_tokens)] for r in range(B)]
        fns: dict[str, Callable[[], dict[str, float]]] = {
            v: partial(variant_fn, model, prompts, steps, v, trio_us) for v in VARIANTS
        }
        for fn in fns.values():  # warm-up
            fn()
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in fns}
        for _ in range(repeats):
            for v, fn in fns.items():
                runs[v].append(fn())
        med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
        base = med["batchkv"]["ms"]
        for v, m in med.items():
            split = " | ".join(f"{m[k]:.2f}" if k in m else "" for k in ("build", "launch", "wait"))
            print(f"| {B} | {v} | {m['ms']:.2f} | {m['cpu']:.2f} | {split} | {base / m['ms']:.2f} |", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--steps", type=int, default=72)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trio-us", type=float, default=180.0, help="Trio-thread work per report in chain+trio (µs)")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="mlx-trio-variants-") as tmp:
        model_dir = tiny_tokenizer_dir() if args.shape == "tiny" else build_shape(args.shape, Path(tmp), None)
        run_in_mlx_thread(lambda: run(model_dir, batches, args.steps, args.prompt_tokens, args.repeats, args.trio_us))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
