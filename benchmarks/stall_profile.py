"""Where the decode stall goes while a long prompt prefills: stream gaps against the lease's job log.

Usage (H200, see benchmarks/gpu.sh for staging):
    python benchmarks/stall_profile.py --shape llama-1b --streams 4 --long-tokens 8500
    MLX_TRIO_ATTENTION_BACKEND=cudnn-prefill python benchmarks/stall_profile.py ... --prefill-chunk-ms 40,100 \
        --cudnn-warm-tokens 9216   (idle time plans only the 8.5k prompt's chunk shapes; none before it is ready)
    (a CPU check: python benchmarks/stall_profile.py --streams 2 --long-tokens 1500 --rounds 1 --stream-tokens 600)

`--prefill-chunk-ms` takes a comma list: each target runs in turn on a fresh engine in this
process (a fresh lease thread, so cuDNN's per-thread plans start cold for each; MLX's attention
backend is chosen once per process: engine/lease_thread.py), then one summary table.

In one process, on the embedded engine (no HTTP): `--streams` requests decode
(128-token prompts, long `max_tokens`); once all of them have tokens, one
`--long-tokens` prompt arrives, `--rounds` times one after another (fresh
prompts). Every GPU-lease job is logged (name, start, end;
`GpuLease.job_log`). Per round: the long prompt's TTFT, the lease jobs until
then by name, the largest gaps between consecutive tokens of any decoding
stream from its arrival until 1 s after its first token, and for each gap
the jobs that ran inside it and the lease's idle time there (time the lease
thread waited for Trio), and the Trio task steps over 2 ms inside it.
`--streams 0` measures the prefill alone.

`--http` runs the same through `mlx-trio serve`'s HTTP server, in this
process (so its lease can be logged), with the SSE client in another
(stall_client.py): chat completions, `--long-words` of text as the long
prompt, token times when the client read each content chunk. The streams
run to their end (so that their usage counts arrive): size `--stream-tokens`
to just outlast the rounds (1500 on the H200's 1B shape).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

from mlx_trio import open_engine
from mlx_trio.cli import serve
from mlx_trio.config import EngineConfig
from mlx_trio.engine import lease_thread
from mlx_trio.events import TextDelta
from mlx_trio.http.server.config import ServerConfig
from mlx_trio.testing.shaped_models import SHAPES, resolve_model


@attrs.frozen
class Profile:
    """Token arrival times per stream, (arrival, first token) per long prompt, lease jobs, slow Trio steps."""

    times: list[list[float]]
    rounds: list[tuple[float, float]]
    log: list[tuple[str, float, float]]
    trio_steps: list[tuple[str, float, float]]
    start_s: float = 0.0  # from opening the engine to its warm-up request's end
    plans: int = 0  # prefill chunk shapes planned by then, in idle time (actors/plan_warmup.py)


async def profile(model_dir: Path, args: argparse.Namespace) -> None:
    """Each `--prefill-chunk-ms` target in turn, on a fresh engine (a fresh lease thread: cuDNN's plans are per thread)."""
    summary = []
    for target in args.prefill_chunk_ms:
        one = argparse.Namespace(**{**vars(args), "prefill_chunk_ms": target})
        measured = await (over_http if args.http else embedded)(model_dir, one)
        print(f"\n# --prefill-chunk-ms {target:g}, attention backend: {lease_thread.chosen_backend()}; engine start "
              f"+ warm-up request {measured.start_s:.1f} s, cuDNN prefill plans built by then: {measured.plans}")
        rows = [report(n, arrived, first, measured, one) for n, (arrived, first) in enumerate(measured.rounds, 1)]
        summary.append({"prefill_chunk_ms": target, "backend": lease_thread.chosen_backend(),
                        "start_s": measured.start_s, "cudnn_plans": measured.plans,
                        "long_ttft_ms": [r[0] for r in rows], "largest_gap_ms": [r[1] for r in rows],
                        "steady_gap_ms": [r[2] for r in rows]})
    print("\n| backend | `--prefill-chunk-ms` | long TTFT ms | largest gap ms | inter-token gap before ms |")
    print("|---|---:|---|---|---|")
    for row in summary:
        print(f"| {row['backend']} | {row['prefill_chunk_ms']:g} | " + " | ".join(
            " / ".join(f"{v:.0f}" if v is not None else "-" for v in row[k])
            for k in ("long_ttft_ms", "largest_gap_ms", "steady_gap_ms")) + " |")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))



class SlowTrioSteps(trio.abc.Instrument):
    """Trio task steps longer than `min_s`: (task name, start, end) on the perf_counter clock."""

    def __init__(self, min_s: float = 0.002) -> None:
        self.min_s = min_s
        self.steps: list[tuple[str, float, float]] = []
        self._start = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._start = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        end = time.perf_counter()
        if end - self._start > self.min_s:
            self.steps.append((task.name.rsplit(".", 1)[-1], self._start, end))


@contextlib.contextmanager
def recording(lease: Any) -> Iterator[tuple[list[tuple[str, float, float]], list[tuple[str, float, float]]]]:
    """While inside: the lease's jobs and the slow Trio task steps, appended to the two lists yielded."""
    slow = SlowTrioSteps()
    lease.job_log = log = []
    trio.lowlevel.add_instrument(slow)
    try:
        yield log, slow.steps
    finally:
        trio.lowlevel.remove_instrument(slow)
        lease.job_log = None


async def embedded(model_dir: Path, args: argparse.Namespace) -> Profile:
    """The streams and the long prompts on the embedded engine; token times from its events."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(128)] for _ in range(args.streams)]
    opened = time.perf_counter()
    async with open_engine(str(model_dir), batch=max(args.streams + 1, 2), prefill_step_size=args.prefill_step_size,
                           prefill_chunk_ms=args.prefill_chunk_ms, cudnn_warm_tokens=args.cudnn_warm_tokens) as engine:
        await engine.complete(prompts[0] if prompts else [5] * 128, max_tokens=4)  # warm-up: a short request
        start_s, plans = time.perf_counter() - opened, engine.actors.lane.prefill.statistics().cudnn_plans
        times: list[list[float]] = [[] for _ in prompts]
        all_started = trio.Event()
        if not prompts:
            all_started.set()

        async def stream(i: int) -> None:
            async for event in engine.generate(prompts[i], max_tokens=args.stream_tokens):
                if isinstance(event, TextDelta):
                    times[i].extend([time.perf_counter()] * len(event.token_ids))
                    if all(times):
                        all_started.set()

        async def long() -> float:
            long_prompt = [rng.randrange(3, 500) for _ in range(args.long_tokens)]
            async for event in engine.generate(long_prompt, max_tokens=8):
                if isinstance(event, TextDelta):
                    return time.perf_counter()
            raise RuntimeError("the long prompt produced no token")

        rounds: list[tuple[float, float]] = []  # (arrival, first token) of each long prompt
        with recording(engine.actors.lane.lease) as (log, trio_steps):
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(stream, i)
                await all_started.wait()
                for _ in range(args.rounds):
                    await trio.sleep(0.5)
                    arrived = time.perf_counter()
                    rounds.append((arrived, await long()))
                    await trio.sleep(1.0)
                nursery.cancel_scope.cancel()
    return Profile(times, rounds, log, trio_steps, start_s, plans)


async def over_http(model_dir: Path, args: argparse.Namespace) -> Profile:
    """The same through `mlx-trio serve`'s HTTP server in this process, the SSE client in another.

    Token times are when the client read each content chunk (stall_client.py).
    """
    engine_config = EngineConfig(model=str(model_dir), batch=max(args.streams + 1, 8),
                                 prefill_step_size=args.prefill_step_size, prefill_chunk_ms=args.prefill_chunk_ms,
                                 cudnn_warm_tokens=args.cudnn_warm_tokens)
    opened = time.perf_counter()
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, engine_config, ServerConfig(port=0, batch=engine_config.batch))
        gc.freeze()  # as `mlx-trio serve` does once ready
        await server.engine.complete([5] * 128, max_tokens=4)  # warm-up: a short request
        start_s, plans = time.perf_counter() - opened, server.engine.actors.lane.prefill.statistics().cudnn_plans
        client = [sys.executable, str(Path(__file__).with_name("stall_client.py")), "--url", server.url,
                  "--streams", str(args.streams), "--stream-tokens", str(args.stream_tokens),
                  "--long-words", str(args.long_words), "--rounds", str(args.rounds)]
        with recording(server.engine.actors.lane.lease) as (log, trio_steps):
            done = await trio.run_process(client, capture_stdout=True)
        nursery.cancel_scope.cancel()
    measured = json.loads(done.stdout)
    chunks = sum(len(ts) for ts in measured["streams"])
    tokens = sum(n or 0 for n in measured["tokens"])
    print(f"  SSE streams: {tokens} tokens in {chunks} content chunks ({tokens / max(chunks, 1):.2f} per chunk)")
    return Profile(measured["streams"], [tuple(r) for r in measured["rounds"]], log, trio_steps, start_s, plans)


def report(n: int, arrived: float, first: float, profile: Profile,
           args: argparse.Namespace) -> tuple[float, float | None, float | None]:
    """Print the long prompt's TTFT, the streams' largest gaps around it and the lease jobs inside them.

    Returns (TTFT, largest gap, median inter-token gap before the long prompt), ms.
    """
    times, log = profile.times, profile.log
    long = f"{args.long_words} words" if args.http else f"{args.long_tokens} tokens"
    print(f"\n## round {n}: long prompt {long}, TTFT {1e3 * (first - arrived):.0f} ms")
    window = [(name, s, e) for name, s, e in log if arrived <= s <= first]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, s, e in window:
        by_name[name].append(1e3 * (e - s))
    for name, d in sorted(by_name.items()):
        print(f"  jobs until TTFT: {name} x{len(d)}, median {statistics.median(d):.1f} ms, max {max(d):.1f} ms")
    gaps = []
    for i, ts in enumerate(times):
        for a, b in zip(ts, ts[1:]):
            if b > a and b >= arrived and a <= first + 1.0:
                gaps.append((b - a, a, b, i))
    # Every stream sees the same gap when a job stalls them all: show each moment once.
    gaps = sorted({round(a, 3): (gap, a, b, i) for gap, a, b, i in gaps}.values(), reverse=True)
    steady = sorted(b - a for ts in times for a, b in zip(ts, ts[1:]) if b > a and b < arrived)
    steady_ms = 1e3 * steady[len(steady) // 2] if steady else None
    if steady_ms is not None:
        print(f"  inter-token gap before the long prompt: median {steady_ms:.1f} ms")
    for gap, a, b, i in gaps[:args.top]:
        inside = [(name, s, e) for name, s, e in log if e > a and s < b]
        busy = sum(min(e, b) - max(s, a) for _, s, e in inside)
        jobs = ", ".join(f"{name} {1e3 * (e - s):.1f} ms" for name, s, e in inside)
        print(f"  gap {1e3 * gap:7.1f} ms at +{1e3 * (a - arrived):.0f} ms: lease idle {1e3 * (gap - busy):.1f} ms; "
              f"jobs: {jobs}")
        slow = [(name, s, e) for name, s, e in profile.trio_steps if e > a and s < b]
        if slow:
            print("      Trio steps over 2 ms: " + ", ".join(f"{name} {1e3 * (e - s):.1f} ms" for name, s, e in slow))
    return 1e3 * (first - arrived), (1e3 * gaps[0][0] if gaps else None), steady_ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=4000)
    p.add_argument("--long-tokens", type=int, default=8500)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--prefill-chunk-ms", type=lambda v: [float(x) for x in v.split(",")],
                   default=[attrs.fields(EngineConfig).prefill_chunk_ms.default],
                   help="the busy prefill chunk's target time (the server's flag); a comma list runs each in turn")
    p.add_argument("--cudnn-warm-tokens", type=int, default=attrs.fields(EngineConfig).cudnn_warm_tokens.default,
                   help="the server's flag: under MLX_TRIO_ATTENTION_BACKEND=cudnn-prefill, idle time builds "
                        "cuDNN's prefill plans of contexts up to this many tokens (never before readiness)")
    p.add_argument("--model", help="a model directory (wins over --shape), e.g. gpu.sh's built shape")
    p.add_argument("--json", type=Path, help="write the per-round summary here")
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2, help="long prompts, one after another (the first pays JIT)")
    p.add_argument("--http", action="store_true",
                   help="through the HTTP server (chat completions over SSE, the client in another process)")
    p.add_argument("--long-words", type=int, default=2500,
                   help="--http: the long prompt's words (about 3.4 tokens each with the shapes' tokenizer)")
    args = p.parse_args()
    sys.setswitchinterval(0.001)  # as `mlx-trio serve`
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, label = resolve_model(Path(tmp), shape=None if args.model else args.shape, model=args.model,
                                         num_layers=args.num_layers)
        print(f"# {label}")
        trio.run(profile, model_dir, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
