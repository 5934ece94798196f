"""HTTP serving against the engine's own decode, and per-row options against greedy, in one process tree (issue #20).

Usage:
    python benchmarks/serve_vs_engine.py --tiny                        # this CPU, tiny random llama, < 2 min
    python benchmarks/serve_vs_engine.py --model /tmp/mlx-trio-gpu-models/llama-1b   # the H200 (gpu.sh PARTS=options)
    python benchmarks/serve_vs_engine.py --model DIR --kinds greedy --concurrency 8,64   # the 8B point: 64 rows vs 8
    python benchmarks/serve_vs_engine.py --model DIR --mlx-lm --json out.json            # and mlx_lm.server
    python benchmarks/serve_vs_engine.py --model DIR --split-src /tmp/base   # A/B: a second server of another commit
                                          # (git archive BASE mlx_trio | tar -x -C /tmp/base; its package runs there)

Issue #20's "Done when" compares ratios measured on one machine instance, and
the H200s differ by ±30 % between calls, so every number of a ratio comes
from this one process tree, in rounds that alternate the loads' order:

* **engine**: this process opens the engine (`open_engine`, `--batch` rows,
  no cuDNN plans of its own: none in idle time while the servers run)
  and runs `benchmarks/batch_throughput.py`'s `engine_run` at B = each
  concurrency: B concurrent 32-token prompts, `--output-tokens` tokens each,
  the decode-window tok/s (the reference of the ratios);
* **ours**: one `mlx-trio serve --batch N` process, warmed up, then closed-loop
  runs of the bench's `uniform` workload (every request at once, `mlx-trio
  bench`'s runner): short prompts (`--prompt-words`), `--output-tokens`
  tokens, `--requests-per-stream` × c requests, one run per `--kinds` entry
  (the per-row sampling options of every request: `--options` of the bench),
  and a long-prompt load (`--long-prompt-words`, every row with a 2-token
  logit_bias);
* **mlx_lm** (`--mlx-lm`): mlx_lm.server (`--decode-concurrency N`) on the same
  model, greedy.

Every server serves an EOS-free copy of the model (`resolve_model`), so no
request needs a logit_bias but the ones its kind gives it and every row
decodes exactly `--output-tokens` tokens. A 200 with no token counts as a
failure (the bench's client). Printed: one line per run as it ends, then one
markdown table (per load and c: tok/s as the median of the rounds and each
round, TTFT p50/p95 at the first non-empty text, failures, GPU busy from
nvidia-smi where it exists) and the ratios the issue's Done-when names, each
with its target. `--json` keeps every run's summary and requests.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from mlx_trio import open_engine
from mlx_trio.bench import gpu_busy, metrics, workloads
from mlx_trio.bench.orchestrate import until_sigterm
from mlx_trio.bench.runner import RunOptions, run_matrix, run_workload, warmup
from mlx_trio.bench.servers import ManagedServer, plans_settled
from mlx_trio.testing.shaped_models import resolve_model

from batch_throughput import SERVE_SWITCH_INTERVAL_S, engine_run, pick_prompts


ENGINE_PROMPT_TOKENS = 32
LONG = "long"  # the long-prompt load's kind label (its rows carry a logit_bias)
# --tiny's defaults: the tiny random llama on this CPU, each run about a second.
TINY_DEFAULTS = {"concurrency": [2, 8], "batch": 8, "output_tokens": 16, "long_prompt_words": 60,
                 "warmup_tokens": 4}


@attrs.frozen
class Load:
    """One measured thing at one concurrency: the engine, or a server given one kind of request."""

    target: str  # "engine", "ours" or "mlx_lm"
    kind: str  # an option kind of the uniform workload, LONG, or "decode" (the engine)

    @property
    def label(self) -> str:
        return self.target if self.target == "engine" else f"{self.target} {self.kind}"


def loads(args: argparse.Namespace) -> list[Load]:
    """Every load of one concurrency, in round 1's order (round 2 reverses it)."""
    out = [Load("engine", "decode")]
    for target in ours_targets(args):
        out.extend(Load(target, kind) for kind in args.kinds)
        if args.long_prompt_words:
            out.append(Load(target, LONG))
    if args.mlx_lm:
        out.append(Load("mlx_lm", "greedy"))
    return out


def ours_targets(args: argparse.Namespace) -> list[str]:
    """Our servers: "ours" (`--server-args`), and "split" (the same plus `--split-args`, `--split-env`, or run from
    `--split-src`'s checkout) when one of those is given."""
    return ["ours", "split"] if _splits(args) else ["ours"]


def params_for(load: Load, args: argparse.Namespace, concurrency: int, seed: int) -> workloads.WorkloadParams:
    """The uniform workload of one HTTP run: closed loop, `requests_per_stream` × c requests."""
    long = load.kind == LONG
    return workloads.WorkloadParams(
        num_requests=args.requests_per_stream * concurrency, seed=seed, rate_per_s=None,
        output_tokens=args.output_tokens, prompt_words=args.long_prompt_words if long else args.prompt_words,
        options="logit_bias" if long else load.kind)


async def with_gpu_busy(fn: Callable[[], Awaitable[Any]]) -> tuple[Any, float | None]:
    """`fn()`'s result and the GPU's mean busy % while it ran (None without nvidia-smi)."""
    busy: list[float] = []
    async with trio.open_nursery() as nursery:
        if gpu_busy.available():
            nursery.start_soon(gpu_busy.sample, busy)
        result = await fn()
        nursery.cancel_scope.cancel()
    return result, gpu_busy.mean(busy)


def _request(result: Any) -> dict[str, Any]:
    """A request's record without its inter-token gaps (the JSON stays small; the summary keeps their percentiles)."""
    return {k: v for k, v in attrs.asdict(result).items() if k != "itl_s"}


async def measure(load: Load, concurrency: int, round_index: int, seed: int, engine: Any,
                  servers: dict[str, ManagedServer], args: argparse.Namespace) -> dict[str, Any]:
    """One run of `load` at `concurrency`: its tok/s, TTFT, failures and GPU busy (and the raw numbers)."""
    run: dict[str, Any] = {"target": load.target, "kind": load.kind, "label": load.label, "c": concurrency,
                           "round": round_index}
    if load.target == "engine":
        prompts = pick_prompts(concurrency, ENGINE_PROMPT_TOKENS, engine.model.vocab_size, seed)
        out, busy = await with_gpu_busy(lambda: engine_run(engine, prompts, args.output_tokens))
        return run | {"tok_s": out["dec_tok_s"], "e2e_tok_s": out["e2e_tok_s"], "gpu_busy": busy,
                      # Rows are not told apart here: 1 when any row decoded fewer tokens than asked.
                      "failures": int(out["min_row_tokens"] < args.output_tokens),
                      "engine": {k: v for k, v in out.items() if k not in ("dec_start", "dec_end")}}
    server = servers[load.target]
    # The clients run on this process's Trio thread: if its CPU nears the run's wall, the client is the limit.
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    (record,) = await run_matrix([server], "uniform", params_for(load, args, concurrency, seed), [concurrency], 1,
                                 RunOptions(read_timeout_s=args.timeout_s))
    client_cpu_frac = (time.thread_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
    s = metrics.summarize(load.label, concurrency, [record.results])
    return run | {"tok_s": s.output_tok_s, "client_cpu_frac": client_cpu_frac,
                  "content_chunks": sum(r.content_chunks for r in record.results), "ttft_p50_s": s.ttft_p50_s, "ttft_p95_s": s.ttft_p95_s,
                  "failures": s.num_failed, "gpu_busy": record.gpu_busy_percent, "server_died": record.server_died,
                  "prompt_tokens_mean": s.prompt_tokens / s.num_ok if s.num_ok else None,
                  "summary": attrs.asdict(s), "requests": [_request(r) for r in record.results]}


async def warm(engine: Any, servers: dict[str, ManagedServer], args: argparse.Namespace) -> None:
    """First-use costs (compiles, each option kind's first step, the largest batch) outside the measurements."""
    for B in sorted(set(args.concurrency)):
        await engine_run(engine, pick_prompts(B, ENGINE_PROMPT_TOKENS, engine.model.vocab_size, 10**6),
                         args.warmup_tokens)
    for load in loads(args):
        if load.target == "engine":
            continue
        url = servers[load.target].url
        await warmup(url, RunOptions())
        # Every concurrency, as the engine above: a batch size a server first meets in a measured run pays its
        # shapes' first visits there (the H200, c=8 after a c=64-only warm-up: 7 of 8 first tokens ~0.9 s late).
        for c in sorted(set(args.concurrency), reverse=True):
            params = attrs.evolve(params_for(load, args, c, 10**6), num_requests=c, output_tokens=args.warmup_tokens)
            await run_workload(url, workloads.build("uniform", params, c), RunOptions(read_timeout_s=args.timeout_s))


def _splits(args: argparse.Namespace) -> bool:
    """Whether a second server of ours runs beside the first (other flags, environment or checkout)."""
    return bool(args.split_args or args.split_env or args.split_src)


async def bench(model: str, args: argparse.Namespace, workdir: Path, servers: dict[str, ManagedServer],
                runs: list[dict[str, Any]]) -> None:
    """Open the engine, start the servers, warm up, then the rounds; each run appended to `runs` as it ends."""
    servers["ours"] = ManagedServer("ours", "ours", model, workdir / "ours.log",
                                    extra_args=("--batch", str(args.batch), *args.server_args.split()))
    if _splits(args):
        servers["split"] = ManagedServer("split", "ours", model, workdir / "split.log",
                                         extra_args=("--batch", str(args.batch), *args.server_args.split(),
                                                     *args.split_args.split()),
                                         env=dict(item.split("=", 1) for item in args.split_env),
                                         cwd=args.split_src)
    if args.mlx_lm:
        servers["mlx_lm"] = ManagedServer("mlx_lm", "mlx_lm", model, workdir / "mlx_lm.log",
                                          extra_args=("--decode-concurrency", str(args.batch)))
    start = time.perf_counter()
    # No cuDNN plans here: this engine's prefill is 32-token prompts, and an engine that plans shapes in its idle
    # time (actors/plan_warmup.py) would take the GPU and the GIL from the HTTP runs.
    async with open_engine(model, batch=args.batch, cudnn_warm_tokens=0) as engine:
        async with trio.open_nursery() as nursery:
            for server in servers.values():
                nursery.start_soon(server.start)
        await warm(engine, servers, args)
        for target in ours_targets(args):
            # Which kernels it runs: a server that inherited another choice measures something else.
            print(f"# {target}: attention {await plans_settled(servers[target].url)}", flush=True)
        print(f"engine open (attention {engine.status()['counters'].get('attention_backend')}), {len(servers)} "
              f"server(s) up and warm in {time.perf_counter() - start:.0f} s", flush=True)
        # As `mlx-trio serve` does once ready: the engine's and the client's long-lived objects (MLX, mlx-lm,
        # transformers, ~400k on an H200 host) are no longer scanned by full collections, each a ~200 ms pause
        # of this process's engine and of the client timing every server.
        gc.freeze()
        for round_index in range(args.rounds):
            for ci, concurrency in enumerate(args.concurrency):
                order = loads(args)
                for li, load in enumerate(order if round_index % 2 == 0 else order[::-1]):
                    seed = args.seed * 1_000_000 + ci * 10_000 + round_index * 100 + li
                    runs.append(await measure(load, concurrency, round_index, seed, engine, servers, args))
                    print_run(runs[-1])
                    write(args, runs)


def _f(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "" if value is None else f"{value * scale:.{digits}f}"


def print_run(run: dict[str, Any]) -> None:
    ttft = f", TTFT p50 {_f(run.get('ttft_p50_s'), 1e3)} ms" if run.get("ttft_p50_s") is not None else ""
    busy = f", GPU busy {run['gpu_busy']:.0f} %" if run.get("gpu_busy") is not None else ""
    client = (f", client CPU {100 * run['client_cpu_frac']:.0f} % of wall, {run['content_chunks']} chunks"
              if run.get("client_cpu_frac") is not None else "")
    print(f"  round {run['round'] + 1} c={run['c']} {run['label']}: {_f(run['tok_s'])} tok/s{ttft}, "
          f"{run['failures']} failed{busy}{client}", flush=True)


def groups(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """The runs of each (label, c), in round order."""
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        out.setdefault((run["label"], run["c"]), []).append(run)
    return out


def median_tok_s(runs: Sequence[dict[str, Any]], key: str = "tok_s") -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def table(runs: Sequence[dict[str, Any]]) -> None:
    """One row per (load, c): tok/s (median, then each round), TTFT pooled over the rounds, failures, GPU busy."""
    print("\n| load | c | tok/s (median) | tok/s per round | TTFT p50 ms | TTFT p95 ms | failures | "
          "prompt tokens | GPU busy % |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for (label, c), rs in sorted(groups(runs).items(), key=lambda kv: (kv[0][1], kv[1][0]["target"] != "engine")):
        results = [r for run in rs for r in run.get("requests", [])]
        ttft = [r["ttft_s"] for r in results if r["ok"] and r["ttft_s"] is not None]
        busy = [r["gpu_busy"] for r in rs if r.get("gpu_busy") is not None]
        prompt = [r["prompt_tokens_mean"] for r in rs if r.get("prompt_tokens_mean") is not None]
        name = f"engine B={c} (decode)" if label == "engine" else label
        print(f"| {name} | {c} | {_f(median_tok_s(rs))} | {' / '.join(_f(r['tok_s']) for r in rs)} | "
              f"{_f(metrics.percentile(ttft, 50), 1e3)} | {_f(metrics.percentile(ttft, 95), 1e3)} | "
              f"{sum(r['failures'] for r in rs)} | {_f(statistics.fmean(prompt) if prompt else None)} | "
              f"{_f(statistics.fmean(busy) if busy else None, 1, 1)} |")


def ratio_rows(runs: Sequence[dict[str, Any]], concurrency: Sequence[int]) -> list[tuple[str, float | None, str, str]]:
    """(what, ratio of the medians, the per-round ratios, the Done-when target) for every pair that ran."""
    g = groups(runs)
    rows = []

    def add(what: str, a: tuple[str, int], b: tuple[str, int], target: str, key: str = "tok_s",
            b_key: str | None = None) -> None:
        """a's `key` over b's `b_key` (default: the same key)."""
        b_key = b_key or key
        if a not in g or b not in g:
            return
        if key == "ttft_p50_s":  # a latency: pooled percentiles of both
            value = metrics.ratio(*(_pooled_ttft_p50(g[x]) for x in (a, b)))
        else:
            value = metrics.ratio(median_tok_s(g[a], key), median_tok_s(g[b], b_key))
        per_round = [metrics.ratio(x.get(key), y.get(b_key)) for x, y in zip(g[a], g[b])]
        rows.append((what, value, " / ".join(_f(v, 1, 2) for v in per_round), target))

    top = max(concurrency)
    for ours in ("ours", "split"):
        greedy = f"{ours} greedy"
        for c in concurrency:
            target = {64: "≥ 0.7", 8: "≥ 0.85"}.get(c, "")
            add(f"{greedy} c={c} / engine B={c}", (greedy, c), ("engine", c), target)
            # The engine's rate with its prefill and ramp counted too (the HTTP rate counts them): how much is the ramp.
            add(f"{greedy} c={c} / engine B={c} end to end", (greedy, c), ("engine", c), "", b_key="e2e_tok_s")
        if len(concurrency) > 1:
            low = min(concurrency)
            add(f"{greedy} c={top} / c={low}", (greedy, top), (greedy, low),
                "≥ 3 (8B)" if (low, top) == (8, 64) else "")
        for c in concurrency:
            for label in sorted({label for label, cc in g if cc == c and label.startswith(f"{ours} ")}):
                if label != greedy:
                    add(f"{label} / {greedy}, c={c}", (label, c), (greedy, c),
                        ("≥ 0.5" if label == f"{ours} {LONG}" else "≥ 0.9") if c == 64 else "")
    for c in concurrency:
        add(f"split greedy / ours greedy, c={c}", ("split greedy", c), ("ours greedy", c), "")
    for c in concurrency:
        add(f"ours / mlx_lm.server greedy tok/s, c={c}", ("ours greedy", c), ("mlx_lm greedy", c),
            {64: "≥ 2", 8: "≈ 3"}.get(c, ""))
        add(f"ours / mlx_lm.server greedy TTFT p50, c={c}", ("ours greedy", c), ("mlx_lm greedy", c),
            "≤ 0.3" if c == 8 else "", key="ttft_p50_s")
    return rows


def _pooled_ttft_p50(rs: Sequence[dict[str, Any]]) -> float | None:
    return metrics.percentile([r["ttft_s"] for run in rs for r in run["requests"] if r["ok"] and r["ttft_s"]], 50)


def wall_rows(runs: Sequence[dict[str, Any]]) -> list[tuple[str, int, float, float | None, float | None]]:
    """Where a server's wall goes, per (load, c): (label, c, the share of its requests' time spent waiting for
    their first text, their decode tok/s per row (median), that over the engine's per-row rate at B=c).

    The Done-when ratio (aggregate tok/s over the engine's decode-window tok/s) is about (1 - waiting share)
    x that last ratio: in a closed loop of equal requests every wave of c arrives at once and waits for its
    first tokens with nothing decoding, a cost the engine's decode window does not count.
    """
    g = groups(runs)
    rows = []
    for (label, c), rs in sorted(g.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if label == "engine":
            continue
        done = [r for run in rs for r in run.get("requests", [])
                if r["ok"] and r["ttft_s"] is not None and r["end_s"] > r["start_s"] + r["ttft_s"]]
        if not done:
            continue
        waiting = sum(r["ttft_s"] for r in done) / sum(r["end_s"] - r["start_s"] for r in done)
        per_row = statistics.median(r["completion_tokens"] / (r["end_s"] - r["start_s"] - r["ttft_s"]) for r in done)
        engine = median_tok_s(g[("engine", c)]) if ("engine", c) in g else None
        rows.append((label, c, waiting, per_row, metrics.ratio(per_row, engine / c if engine else None)))
    return rows


def report(runs: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    table(runs)
    walls = wall_rows(runs)
    if walls:
        print("\n| load | c | waiting for first text, share of request time | decode tok/s a row (median) "
              "| / the engine's a row |\n|---|---:|---:|---:|---:|")
        for label, c, waiting, per_row, vs_engine in walls:
            print(f"| {label} | {c} | {_f(waiting, 1, 2)} | {_f(per_row, 1, 1)} | {_f(vs_engine, 1, 2)} |")
    rows = ratio_rows(runs, args.concurrency)
    if rows:
        print("\n| ratio | median | per round | Done-when |\n|---|---:|---|---|")
        for what, value, per_round, target in rows:
            print(f"| {what} | {_f(value, 1, 2)} | {per_round} | {target} |")


def write(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs},
                                        indent=1, default=str))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny random llama on this CPU, small counts (< 2 min)")
    p.add_argument("--model", default=None, help="a model directory (an EOS-free copy is served)")
    p.add_argument("--shape", default=None, help="a benchmark shape to build instead (testing/shaped_models)")
    p.add_argument("--concurrency", type=_ints, default=[8, 64], help="closed-loop streams = engine rows B")
    p.add_argument("--kinds", type=lambda t: t.split(","), default=["greedy", "logit_bias", "penalties", "mixed"],
                   help=f"per-row option kinds of the short-prompt loads, from {','.join(workloads.OPTION_KINDS)}")
    p.add_argument("--batch", type=int, default=64, help="ours --batch, mlx_lm --decode-concurrency, engine rows")
    p.add_argument("--prompt-words", type=int, default=8, help="the short prompts (~30 tokens with the template)")
    p.add_argument("--long-prompt-words", type=int, default=400,
                   help="the long-prompt load (~1200 tokens with the shapes' small BPE); 0: none")
    p.add_argument("--output-tokens", type=int, default=256, help="tokens per request and per engine row")
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per run = this × c")
    p.add_argument("--rounds", type=int, default=2, help="rounds; odd rounds run the loads in reverse order")
    p.add_argument("--warmup-tokens", type=int, default=16, help="max_tokens of the warm-up runs")
    p.add_argument("--mlx-lm", action="store_true", help="also mlx_lm.server, greedy, alternated with ours")
    p.add_argument("--server-args", default="", help="more flags for mlx-trio serve")
    p.add_argument("--split-args", default="",
                   help="also a second mlx-trio serve with these flags too (e.g. '--api-server-count 1'), "
                        "its loads alternated with ours' as 'split'")
    p.add_argument("--split-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable of the second server only (e.g. a kill switch); repeatable")
    p.add_argument("--split-src", default=None, metavar="DIR",
                   help="the second server runs another checkout's mlx_trio (DIR holds its package): an A/B of two commits")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request read timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiny:  # --tiny's counts, unless given
        p.set_defaults(**TINY_DEFAULTS)
        args = p.parse_args(argv)
        args.shape = args.shape or "tiny"
    unknown = set(args.kinds) - set(workloads.OPTION_KINDS)
    if unknown:
        p.error(f"unknown --kinds {','.join(sorted(unknown))}; choose from {','.join(workloads.OPTION_KINDS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sys.setswitchinterval(SERVE_SWITCH_INTERVAL_S)  # as `mlx-trio serve` sets it, for the engine in this process
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlx-trio-serve-vs-engine-") as tmp:
        model_dir, label = resolve_model(Path(tmp), shape=args.shape, model=args.model, num_layers=None)
        print(f"# serve vs engine: {label}; c={args.concurrency}, --batch {args.batch}, kinds {','.join(args.kinds)}, "
              f"{args.prompt_words}-word prompts (long: {args.long_prompt_words}), {args.output_tokens} tokens, "
              f"{args.requests_per_stream}×c requests, {args.rounds} rounds; python {sys.version.split()[0]}",
              flush=True)
        servers: dict[str, ManagedServer] = {}
        finished = False
        try:
            finished = trio.run(until_sigterm, partial(bench, str(model_dir), args, Path(tmp), servers, runs))
        finally:  # every exit path stops the servers, by pid, and reports the runs that finished
            for server in servers.values():
                server.stop()
            print(f"\n## serve vs engine: {len(runs)} run(s){'' if finished else ', cut short'}")
            report(runs, args)
    return 0 if finished else 143


if __name__ == "__main__":
    raise SystemExit(main())
