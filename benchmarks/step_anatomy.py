"""Where one decode step's host time goes: graph building, MLX's launch, the token read (issues #20, #25).

Usage:
    python benchmarks/step_anatomy.py --shape tiny                                   # this CPU, seconds
    python benchmarks/step_anatomy.py --model /tmp/mlx-trio-gpu-models/llama-1b      # the H200 (gpu.sh PARTS=anatomy)

A `DecodeBatch` of B rows (prefilled alone, joined) steps as the decode
actor drives it (`step_decoded`, tokens read one step behind). Each measured
step is cut in three at the moment `mx.async_eval` is called and the moment
it returns (this script wraps that one function; the engine is unchanged):

* **build**: Python making the step's graph (the model's forward, the
  sampler) up to the launch;
* **launch**: `mx.async_eval` itself: MLX walks the graph and, on CUDA,
  encodes and launches every kernel (no waiting for them);
* **read**: the rest of `step_decoded`: reading the previous step's tokens
  (waits for the device when it is behind) and bookkeeping.

The same for the bare loop (the model's forward and an argmax on plain mlx-lm
caches, one step ahead), and the step graph's size: the primitives
`mx.export_to_dot` finds in what one step launches, by kind, so that what a
layer costs in nodes can be read off (run `--num-layers 1` and `2`).
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_trio.params import SamplingParams
from mlx_trio.testing.shaped_models import resolve_model, run_in_mlx_thread


class LaunchClock:
    """Wraps `mx.async_eval` to stamp when each launch starts and ends (and, when asked, to inspect its arrays)."""

    def __init__(self, mx: Any) -> None:
        self._mx = mx
        self._original = mx.async_eval
        self.started = 0.0
        self.ended = 0.0
        self.inspect: Callable[[tuple[Any, ...]], None] | None = None

    def __enter__(self) -> LaunchClock:
        def timed(*arrays: Any) -> None:
            self.started = time.perf_counter()
            if self.inspect is not None:  # before the launch: an evaluated array has no graph left
                self.inspect(arrays)
            self._original(*arrays)
            self.ended = time.perf_counter()

        self._mx.async_eval = timed
        return self

    def __exit__(self, *exc: object) -> None:
        self._mx.async_eval = self._original


def split_steps(step: Callable[[], Any], clock: LaunchClock, steps: int) -> dict[str, float]:
    """Median ms of build / launch / read over `steps` calls of `step`, and the wall per step."""
    parts: dict[str, list[float]] = {"build": [], "launch": [], "read": []}
    wall0 = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        parts["build"].append(clock.started - t0)
        parts["launch"].append(clock.ended - clock.started)
        parts["read"].append(t1 - clock.ended)
    wall = time.perf_counter() - wall0
    out = {k: 1e3 * statistics.median(v) for k, v in parts.items()}
    out["wall"] = 1e3 * wall / steps
    return out


def primitives(mx: Any, clock: LaunchClock, step: Callable[[], Any], workdir: Path) -> collections.Counter[str]:
    """The primitives of the graph that one call of `step` launches, by kind."""
    path = workdir / "step.dot"
    clock.inspect = lambda arrays: mx.export_to_dot(str(path), *arrays)
    try:
        step()
    finally:
        clock.inspect = None
    return collections.Counter(re.findall(r'\[label ="([^"]*)", shape=rectangle\]', path.read_text()))


def engine_rows(loaded: Any, batch: int, seed: int) -> Any:
    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow

    rng = random.Random(seed)
    decode = DecodeBatch(loaded.model)
    joiners = []
    for r in range(batch):
        prompt = [rng.randrange(3, min(loaded.vocab_size, 1000)) for _ in range(rng.randrange(16, 129))]
        row = SoloRow(loaded.model, f"r{r}", prompt, SamplingParams(max_tokens=1 << 20))
        while row.prefill_chunk():
            pass
        joiners.append((row, row.first_token()))
    decode.join_many(joiners)
    return decode


def bare_stepper(mx: Any, model: Any, batch: int) -> Callable[[], Any]:
    """The bare loop's step: forward on plain caches, argmax, launched one step ahead, the previous read."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.array([[1] * 64] * batch)
    logits = model(y, cache=cache)
    state = {"y": mx.argmax(logits[:, -1, :], axis=-1)}
    mx.eval(state["y"])

    def step() -> None:
        previous = state["y"]
        nxt = mx.argmax(model(previous[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        previous.tolist()
        state["y"] = nxt

    return step


def measure(path: Path, batches: list[int], steps: int, rounds: int, workdir: Path) -> list[dict[str, Any]]:
    import mlx.core as mx

    from mlx_trio.engine.model.load import load_model

    loaded = load_model(str(path))
    rows: list[dict[str, Any]] = []
    with LaunchClock(mx) as clock:
        for b in batches:
            decode = engine_rows(loaded, b, seed=b)
            bare = bare_stepper(mx, loaded.model, b)
            for _ in range(5):  # compiles, allocator growth
                decode.step_decoded()
                bare()
            engine_nodes = primitives(mx, clock, decode.step_decoded, workdir)
            bare_nodes = primitives(mx, clock, bare, workdir)
            samples: dict[str, list[dict[str, float]]] = {"engine": [], "bare": []}
            for _ in range(rounds):  # alternated, so a noisy neighbour hits both alike
                samples["engine"].append(split_steps(decode.step_decoded, clock, steps))
                samples["bare"].append(split_steps(bare, clock, steps))
            decode.flush_decoded()
            decode.close()
            mx.clear_cache()
            for name, nodes in (("engine", engine_nodes), ("bare", bare_nodes)):
                med = {k: statistics.median(s[k] for s in samples[name]) for k in ("build", "launch", "read", "wall")}
                rows.append({"B": b, "loop": name, **med, "nodes": sum(nodes.values()),
                             "top": nodes.most_common(12)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help='"tiny" or a shape of mlx_trio.testing.shaped_models')
    p.add_argument("--model", default=None, help="a model directory instead of --shape")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path, label = resolve_model(work, shape=args.shape, model=args.model, num_layers=args.num_layers)
        rows = run_in_mlx_thread(lambda: measure(path, batches, args.steps, args.rounds, work))
    import mlx.core as mx

    print(f"# step anatomy | {label} | {mx.default_device()} | mlx {mx.__version__} | {time.strftime('%Y-%m-%d')}")
    print("| B | loop | build ms | launch ms | read ms | wall ms/step | primitives | largest kinds |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in r["top"])
        print(f"| {r['B']} | {r['loop']} | {r['build']:.2f} | {r['launch']:.2f} | {r['read']:.2f} | "
              f"{r['wall']:.2f} | {r['nodes']} | {top} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
