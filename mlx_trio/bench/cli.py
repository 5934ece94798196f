"""`mlx-trio bench`: its flags, and `run(args)`, which hands parsed flags to `orchestrate.main`.

Hooked into `mlx-trio` by `add_parser(subparsers)` and `run(args)`; also runs
as `python -m mlx_trio.bench`. Exit status: 0 when the bench ran to the end
(failed requests are reported, not fatal), 1 when a server could not start,
2 for a usage error.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from mlx_trio.argtypes import non_negative_int, positive_int
from mlx_trio.bench import workloads

# The stacks `--serve` can start (servers.py knows their command lines). ours-nocache is ours with
# its prompt cache off: the cache's own effect, measured in the same run; ours-cudnn is ours with
# prefill-only cuDNN attention named (MLX_TRIO_ATTENTION_BACKEND=cudnn-prefill: on CUDA the default
# since the eleventh H200 pass), ours-mlx-attention ours with MLX's own attention kernels (=mlx).
STACKS = ("ours", "ours-nocache", "mlx_lm", "ours-cudnn", "ours-mlx-attention")

# Agents arrive as a Poisson process; without --rate they come this fast (sessions per second).
AGENTS_DEFAULT_RATE_PER_S = 4.0
# The workloads whose arrivals are staggered by default (at AGENTS_DEFAULT_RATE_PER_S).
POISSON_BY_DEFAULT = ("agents", "serving", "long-context")


DESCRIPTION = """\
Load-test OpenAI-compatible servers and compare them: each --url (a running server) or --serve
(one this command starts on a free port and stops afterwards) gets the same requests at each
--concurrency, in alternating rounds (A B A B). The table has one row per server and concurrency
(TTFT, inter-token latency and tok/s) and a ratio row, first server over each other one: above 1
is better for the first on tok/s, below 1 on latencies. Needs: pip install 'mlx-trio[bench]'."""

EPILOG = """\
examples:
  mlx-trio bench --serve ours --serve mlx_lm              ours against mlx_lm.server, same model
  mlx-trio bench --url http://127.0.0.1:8080 --concurrency 1,8 --workload uniform
  mlx-trio bench --serve ours --serve ours-nocache --out run.json --plot run.png

Workloads: agents (multi-turn sessions sharing a system prompt, Poisson arrivals), uniform
(independent prompts, each with the sampling options of --options), long-prompt (one long prefill while other streams decode), serving (prompts
log-uniform in --min/--max-prompt-words, outputs --output-tokens..--max-output-tokens, per-row
sampling options mixed, Poisson arrivals), long-context (heavy-tailed 1k-100k-word prompts behind a
shared system prefix, follow-up turns, outputs 50-900, Poisson arrivals; --rates sweeps the rate,
--length-scale shrinks it for a CPU).
More in docs/bench.md."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to `mlx-trio`'s subparsers; returns it."""
    parser = subparsers.add_parser("bench", help="load-test OpenAI-compatible servers, stack against stack",
                                   description=DESCRIPTION, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


class _Target(argparse.Action):
    """--url and --serve append ("url"|"serve", value) to one list, so their order is the table's order."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        targets = list(getattr(namespace, "targets", None) or [])
        targets.append(("url" if option_string == "--url" else "serve", values))
        namespace.targets = targets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = workloads.WorkloadParams()
    arg = parser.add_argument
    parser.set_defaults(targets=[])
    arg("--url", action=_Target, metavar="[NAME=]URL", help="a running OpenAI-compatible server (repeatable)")
    arg("--serve", action=_Target, choices=STACKS,
        help="start this stack on a free loopback port: ours (mlx-trio serve), ours-nocache (the same with "
             "--prompt-cache-bytes 0), ours-cudnn (the same with MLX_TRIO_ATTENTION_BACKEND=cudnn-prefill), "
             "ours-mlx-attention (the same with MLX_TRIO_ATTENTION_BACKEND=mlx) "
             "or mlx_lm (python -m mlx_lm.server); "
             "repeatable. The first server is A in the A/B ratios")
    arg("--model", default=None, help="model directory for --serve (default: our SmolLM2, converted once); "
                                      "also read for EOS ids")
    arg("--workload", choices=workloads.WORKLOADS, default="agents", help="what to send (see below; default: %(default)s)")
    arg("--concurrency", type=_int_list, default=[1, 4, 8, 32], help="concurrent streams, a comma list; one run each (default: 1,4,8,32)")
    arg("--requests", type=positive_int, default=32, help="requests per run (default: %(default)s)")
    arg("--requests-per-stream", type=non_negative_int, default=0,
        help="raise a run's requests to this many per concurrent stream (default: off)")
    arg("--rounds", type=positive_int, default=2, help="runs per server per concurrency, alternated A B A B "
                                                          "(default: %(default)s)")
    arg("--seed", type=non_negative_int, default=0, help="seed of the workload's prompts and arrivals (default: %(default)s)")
    arg("--rate", type=float, default=None,
        help=f"session arrivals per second, Poisson; inf: all at once (default: agents and serving "
             f"{AGENTS_DEFAULT_RATE_PER_S}, others all at once)")
    arg("--output-tokens", type=positive_int, default=d.output_tokens, help="max_tokens of each request (default: %(default)s)")
    arg("--system-words", type=non_negative_int, default=d.system_words,
        help="agents, agent-loop: words in the shared system prompt (default: %(default)s)")
    arg("--task-words", type=positive_int, default=d.task_words, help="agents, agent-loop: words in each task (default: %(default)s)")
    arg("--followup-words", type=positive_int, default=d.followup_words,
        help="agents: words in the second turn (default: %(default)s)")
    arg("--prompt-words", type=positive_int, default=d.prompt_words, help="uniform: words per prompt (default: %(default)s)")
    arg("--options", choices=workloads.OPTION_KINDS, default=d.options,
        help="uniform: the per-row sampling options of every request: greedy (none), logit_bias (2 tokens), "
             "penalties (presence/frequency), sampled (temperature/top_p/seed), mixed (the four in turn) "
             "(default: %(default)s)")
    arg("--long-prompt-words", type=positive_int, default=d.long_prompt_words,
        help="long-prompt: words in the long prompt (default: %(default)s)")
    arg("--long-output-tokens", type=positive_int, default=d.long_output_tokens,
        help="long-prompt: the background streams' length (default: %(default)s)")
    arg("--tool-result-words", type=positive_int, default=d.tool_result_words,
        help="agent-loop: words of each turn's tool result (default: %(default)s)")
    arg("--min-prompt-words", type=positive_int, default=d.min_prompt_words,
        help="serving: shortest prompt, words (default: %(default)s)")
    arg("--max-prompt-words", type=positive_int, default=d.max_prompt_words,
        help="serving: longest prompt, words; lengths are log-uniform in between (default: %(default)s)")
    arg("--max-output-tokens", type=positive_int, default=d.max_output_tokens,
        help="serving: longest output; max_tokens is uniform in --output-tokens..this (default: %(default)s)")
    arg("--rates", type=_float_list, default=None,
        help="sweep these arrival rates (sessions per second, a comma list), each run like one --rate; the "
             "long-context report gives the highest that kept TTFT p90 within --ttft-target (default: --rate only)")
    arg("--length-scale", type=float, default=d.length_scale,
        help="long-context: every length times this; 0.01 turns 1k-100k-word prompts into 10-1000 for a CPU "
             "(default: %(default)s)")
    arg("--max-turns", type=positive_int, default=d.max_turns,
        help="long-context: turns per session at most, follow-ups resending the conversation (default: %(default)s)")
    arg("--ttft-target", type=float, default=5.0,
        help="long-context: the TTFT target, seconds: the share within it, and the rate sweep's bound "
             "(default: %(default)s)")
    arg("--eos-id", type=non_negative_int, action="append", default=None,
        help="EOS token id to suppress with logit_bias -100 (repeatable; default: read from --model)")
    arg("--no-eos-bias", action="store_true", help="send no logit_bias (output lengths then vary)")
    arg("--request-model", default=None, help="`model` field to send (default: none, each server's own)")
    arg("--api-key", default=None, help="bearer token for --url servers")
    arg("--ours-args", type=shlex.split, default=[], help="extra flags for ours, e.g. --ours-args='--batch 32'")
    arg("--mlx-lm-args", type=shlex.split, default=[], help="extra flags for mlx_lm.server")
    arg("--python", default=sys.executable, help="interpreter that runs --serve servers (default: this one)")
    arg("--timeout-s", type=float, default=600.0, help="per-request read timeout, seconds (default: %(default)s)")
    arg("--startup-timeout-s", type=float, default=600.0,
        help="seconds a --serve server gets to start and answer a warm-up request (default: %(default)s)")
    arg("--log-dir", type=Path, default=None, help="server logs (default: a new temporary directory)")
    arg("--out", type=Path, default=None, help="write the JSON document here")
    arg("--from-json", type=Path, default=None, metavar="PATH",
        help="start nothing: print the table of a document written by --out again (with --out/--plot: rewrite it)")
    arg("--plot", type=Path, default=None, help="write a PNG of TTFT and throughput vs concurrency (matplotlib)")
    arg("--no-progress", action="store_true", help="no progress bar")
    arg("--log-level", default="WARNING", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="log verbosity (default: %(default)s)")


def workload_params(args: argparse.Namespace) -> workloads.WorkloadParams:
    rate = args.rate if args.rate is not None else (
        AGENTS_DEFAULT_RATE_PER_S if args.workload in POISSON_BY_DEFAULT else None)
    if rate is not None and (math.isinf(rate) or rate <= 0):
        rate = None
    return workloads.WorkloadParams(
        num_requests=args.requests, seed=args.seed, rate_per_s=rate, output_tokens=args.output_tokens,
        system_words=args.system_words, task_words=args.task_words, followup_words=args.followup_words,
        prompt_words=args.prompt_words, long_prompt_words=args.long_prompt_words,
        long_output_tokens=args.long_output_tokens, tool_result_words=args.tool_result_words,
        min_prompt_words=args.min_prompt_words, max_prompt_words=max(args.min_prompt_words, args.max_prompt_words),
        max_output_tokens=max(args.output_tokens, args.max_output_tokens), options=args.options,
        length_scale=args.length_scale, max_turns=args.max_turns,
    )


def run(args: argparse.Namespace) -> int:
    """Run the bench described by parsed `args`; print the table; return the exit status."""
    if not args.targets and args.from_json is None:
        print("mlx-trio bench: give at least one --url or --serve (or --from-json)", file=sys.stderr)
        return 2
    try:
        import httpx  # noqa: F401  (a dependency of the bench only)
    except ImportError:
        print("mlx-trio bench: needs httpx: pip install 'mlx-trio[bench]'", file=sys.stderr)
        return 2
    # Imported here so that `mlx-trio serve` never loads the bench's HTTP client.
    from mlx_trio.bench.orchestrate import main, main_from_json

    return main_from_json(args) if args.from_json is not None else main(args)


def _float_list(text: str) -> list[float]:
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise argparse.ArgumentTypeError("needs positive finite rates, e.g. 1,2,4")
    return values


def _int_list(text: str) -> list[int]:
    values = [positive_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("needs at least one value")
    return values
