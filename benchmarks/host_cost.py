"""Host CPU per decode step and per token of a full batch, by per-row sampling options (issue 20, "CPU").

Usage:
    python benchmarks/host_cost.py                                  # tiny model, B=64, CPU or GPU
    python benchmarks/host_cost.py --shape llama-1b --batch 64 --json out.json
    PYTHONPATH=/tmp/sampling-base python benchmarks/host_cost.py    # the same on another checkout
    python benchmarks/host_cost.py --split --scenarios greedy       # where a step's CPU goes (see below)

    # Two checkouts A/B, alternated in rounds in one process tree (a noisy host hits both alike); this
    # script from the newer one (the older may lack --split), the package from each on PYTHONPATH:
    for r in 1 2 3; do for side in base branch; do
      PYTHONPATH=/path/to/$side python benchmarks/host_cost.py --model /tmp/mlx-trio-gpu-models/llama-1b
        --batch 64 --steps 200 --repeats 3 --split --label $side --json /tmp/host_cost-$side-$r.json   # one line
    done; done

Compare the parts as multiples of the same run's forward build (identical code on both sides: the
"÷ forward" columns): on a shared host that cancels most of the noise that moves whole runs by tens
of percent.

For each scenario, B rows (random prompts of 8-40 tokens) prefill alone and
join one `DecodeBatch`, which then steps as the decode actor drives it
(`step_decoded`, tokens read one step behind). Measured on the thread that
does the MLX work (the lease thread's role) over `--steps` steps: its CPU
time (`time.thread_time`: graph building, sampling bookkeeping, reading the
register; not the kernels, which MLX runs on its own threads, nor waiting for
them) and the wall time. Scenarios:

* ``greedy``     every row plain greedy;
* ``bias2``      every row greedy with a 2-token `logit_bias` (its own tokens);
* ``penalties``  every row greedy with repetition 1.1, presence 0.5, frequency 0.3 (windows of 20);
* ``mixed``      rows in turn: greedy; seeded T=0.8 top_p=0.9; seeded T=1.0 top_k=20 min_p=0.05;
                 greedy with a 2-token bias, repetition 1.1 and 3 top logprobs.

The model is loaded as the engine loads it (`load_model`: fused projections,
so the lean decode forward of engine/model/decode_forward.py where it applies).

``--split`` cuts each step's CPU in five (thread time; the script wraps the
batch's own methods and `mx.async_eval` on this one batch, the engine is
unchanged): **forward** (building the model forward's graph: `_forward`),
**sample** (building the sampler's graph), **launch** (`mx.async_eval`: MLX
walks the step's graph and, on a GPU, encodes and launches its kernels),
**read** (the register's `tolist()`, grammars, logprob records) and **rest**
(every other line of `step_decoded`: the per-step bookkeeping). "outside"
is what is neither the forward's build nor the launch: sample + read + rest.

Rounds run the scenarios in turn (`--repeats`), so a noisy neighbour hits all
of them alike; the table shows medians and each scenario's CPU relative to
``greedy``. Only the package's engine room is used (`SoloRow`, `DecodeBatch`),
so the script runs unchanged against an older checkout on `PYTHONPATH`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mlx_trio.params import SamplingParams
from mlx_trio.testing.shaped_models import resolve_model, run_in_mlx_thread

SCENARIOS = ("greedy", "bias2", "penalties", "mixed")
MAX_TOKENS = 1 << 20  # rows never finish on their own: the benchmark decides how many steps run


def row_params(scenario: str, row: int, vocab_size: int) -> SamplingParams:
    bias = (((7 * row + 11) % vocab_size, 2.0), ((13 * row + 5) % vocab_size, -3.0))
    if scenario == "greedy":
        return SamplingParams(max_tokens=MAX_TOKENS)
    if scenario == "bias2":
        return SamplingParams(max_tokens=MAX_TOKENS, logit_bias=bias)
    if scenario == "penalties":
        return SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.1, presence_penalty=0.5,
                              frequency_penalty=0.3)
    kind = row % 4
    if kind == 0:
        return SamplingParams(max_tokens=MAX_TOKENS)
    if kind == 1:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=row)
    if kind == 2:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=20, min_p=0.05, seed=row)
    return SamplingParams(max_tokens=MAX_TOKENS, logit_bias=bias, repetition_penalty=1.1, logprobs=True,
                          top_logprobs=3)


PARTS = ("forward", "sample", "launch", "read")


class PartClock:
    """Thread time inside a few functions of one batch (`--split`): each wrapped on its own object only."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = dict.fromkeys(PARTS, 0.0)

    def wrap(self, owner: Any, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[part] += time.thread_time() - start

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)


def measure(model: Any, vocab_size: int, scenario: str, batch: int, steps: int, warmup: int,
            seed: int, compile_decode: bool = False, split: bool = False) -> dict[str, float]:
    """One scenario once: B rows prefilled and joined, `warmup` steps, then `steps` measured steps."""
    import mlx.core as mx

    from mlx_trio.engine.batch.decode_batch import DecodeBatch
    from mlx_trio.engine.batch.solo_row import SoloRow

    rng = random.Random(seed)
    # Only a --compile run passes the option, so the script still runs against checkouts without it.
    decode = DecodeBatch(model, compile_decode=True) if compile_decode else DecodeBatch(model)
    joiners = []
    for r in range(batch):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(8, 41))]
        row = SoloRow(model, f"r{r}", prompt, row_params(scenario, r, vocab_size))
        while row.prefill_chunk():
            pass
        joiners.append((row, row.first_token()))
    decode.join_many(joiners)
    clock = PartClock()
    if split:
        # The module's `mx` is mlx.core itself: wrapped for this measurement only, put back below.
        launch = mx.async_eval
        clock.wrap(decode, "_forward", "forward")
        clock.wrap(decode._sampler, "sample", "sample")
        clock.wrap(decode, "_read", "read")
        clock.wrap(mx, "async_eval", "launch")
    try:
        for _ in range(warmup):
            decode.step_decoded()
        clock.reset()
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            decode.step_decoded()
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    finally:
        if split:
            mx.async_eval = launch
    decode.flush_decoded()
    decode.close()
    mx.clear_cache()
    out = {"cpu_ms_per_step": 1e3 * cpu / steps, "cpu_us_per_token": 1e6 * cpu / (steps * batch),
           "wall_ms_per_step": 1e3 * wall / steps, "tok_per_s": steps * batch / wall}
    if split:
        parts = {part: 1e6 * spent / steps for part, spent in clock.spent.items()}
        parts["rest"] = 1e6 * cpu / steps - sum(parts.values())
        parts["outside"] = parts["sample"] + parts["read"] + parts["rest"]
        out.update({f"{part}_us": us for part, us in parts.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", help='"tiny" (default) or a shape of mlx_trio.testing.shaped_models')
    parser.add_argument("--model", default=None, help="a model directory instead of --shape")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--compile", action="store_true",
                        help="compiled decode steps (engine/batch/compiled_step.py; default: uncompiled, as before)")
    parser.add_argument("--split", action="store_true",
                        help="also each step's CPU by part: forward build, sample, launch, read, rest (see above)")
    parser.add_argument("--label", default="", help="names the checkout in the report (e.g. main, branch)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")

    with tempfile.TemporaryDirectory() as tmp:
        path, model_label = resolve_model(Path(tmp), shape=None if args.model else args.shape, model=args.model,
                                          num_layers=args.num_layers)

        def run() -> dict[str, Any]:
            import mlx.core as mx

            from mlx_trio.engine.model.load import load_model

            loaded = load_model(str(path))
            model, vocab_size = loaded.model, loaded.vocab_size
            results: dict[str, list[dict[str, float]]] = {s: [] for s in scenarios}
            for s in scenarios:  # warm-up round: compiles and allocator growth, not recorded
                measure(model, vocab_size, s, args.batch, max(5, args.steps // 10), 2, seed=0,
                        compile_decode=args.compile)
            for repeat in range(args.repeats):
                for s in scenarios:
                    results[s].append(measure(model, vocab_size, s, args.batch, args.steps, args.warmup,
                                              seed=repeat, compile_decode=args.compile, split=args.split))
            return {"device": str(mx.default_device()), "results": results}

        out = run_in_mlx_thread(run)

    import mlx.core as mx

    medians = {s: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for s, runs in out["results"].items()}
    base = medians.get("greedy", next(iter(medians.values())))["cpu_ms_per_step"]
    print(f"# host_cost {args.label}{' compiled' if args.compile else ''} | {model_label} | B={args.batch} | {args.steps} steps x {args.repeats} | "
          f"{out['device']} | mlx {mx.__version__} | {platform.node()} {platform.machine()} | "
          f"{datetime.date.today().isoformat()}")
    print("| scenario | CPU ms/step | CPU µs/token | CPU vs greedy | wall ms/step | tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for s, m in medians.items():
        print(f"| {s} | {m['cpu_ms_per_step']:.2f} | {m['cpu_us_per_token']:.1f} | "
              f"{m['cpu_ms_per_step'] / base:.2f} | {m['wall_ms_per_step']:.2f} | {m['tok_per_s']:.0f} |")
    if args.split:
        print()
        print("| scenario | forward µs | sample µs | launch µs | read µs | rest µs | outside µs (sample+read+rest) | "
              "rest ÷ forward | outside ÷ forward |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for s, m in medians.items():
            print(f"| {s} | {m['forward_us']:.0f} | {m['sample_us']:.0f} | {m['launch_us']:.0f} | "
                  f"{m['read_us']:.0f} | {m['rest_us']:.0f} | {m['outside_us']:.0f} | "
                  f"{m['rest_us'] / m['forward_us']:.3f} | {m['outside_us'] / m['forward_us']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "model": model_label, "batch": args.batch,
                                         "steps": args.steps, "device": out["device"], "medians": medians,
                                         "runs": out["results"]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
