"""What a quoted number needs beside it: machine, date, versions, model, command.

Versions come from installed package metadata, so nothing here imports mlx.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Packages whose versions change the numbers (the MLX backend is one of the mlx-* wheels).
VERSIONED = ("mlx-trio", "mlx", "mlx-cpu", "mlx-cuda", "mlx-cuda-12", "mlx-cuda-13", "mlx-metal", "mlx-lm", "httpx",
             "trio")


def versions() -> dict[str, str]:
    """Installed versions of `VERSIONED` packages (missing ones left out)."""
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def machine() -> dict[str, Any]:
    return {"machine": platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def command_line(argv: Sequence[str]) -> str:
    """The command as a reader would retype it: `mlx-trio bench ...` or `python -m mlx_trio.bench ...`."""
    if not argv:
        return ""
    program = Path(argv[0])
    if program.name == "__main__.py" and program.parent.name == "bench":
        return shlex.join(["python", "-m", "mlx_trio.bench", *argv[1:]])
    return shlex.join([program.name, *argv[1:]])


def run_metadata(args: argparse.Namespace, *, model: str | None, eos_ids: Sequence[int], params: Mapping[str, Any],
                 servers: Sequence[Mapping[str, Any]], log_dir: str) -> dict[str, Any]:
    """The JSON `meta` block, plus two human lines (`workload_line`, `machine_line`) for the printed report."""
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    found, box = versions(), machine()
    rate = params.get("rate_per_s")
    if args.workload == "long-prompt":
        shape = (f"C background streams of {params['long_output_tokens']} tokens, then 1 prompt of "
                 f"{params['long_prompt_words']} words and {params['output_tokens']} output tokens")
    elif args.workload == "long-context":
        rates = getattr(args, "rates", None)
        arrivals = (f"Poisson sweep {','.join(f'{r:g}' for r in rates)}/s" if rates
                    else "all at once" if rate is None else f"Poisson {rate}/s")
        shape = (f"{params['num_requests']} requests/run, prompts 1k-100k words heavy-tailed (mean ~12k) behind a "
                 f"shared system prefix, up to {params['max_turns']} turns a session, outputs 50-900 tokens, "
                 f"lengths x{params['length_scale']:g}, arrivals {arrivals}")
    else:
        arrivals = "all at once" if rate is None else f"Poisson {rate}/s"
        outputs = (f"{params['output_tokens']}-{params['max_output_tokens']} output tokens, prompts "
                   f"{params['min_prompt_words']}-{params['max_prompt_words']} words log-uniform, sampling mixed"
                   if args.workload == "serving" else f"{params['output_tokens']} output tokens")
        if args.workload == "uniform" and params.get("options", "greedy") != "greedy":
            outputs += f", sampling options {params['options']}"
        shape = f"{params['num_requests']} requests/run, {outputs}, arrivals {arrivals}"
    workload_line = (f"concurrency C = {','.join(map(str, args.concurrency))}, {args.rounds} round(s) A B A B, "
                     f"{shape}, seed {args.seed}, EOS ids suppressed {list(eos_ids)}")
    machine_line = (
        f"{now.date()} · {box['machine']} {box['cpus']} CPUs · "
        + " ".join(f"{k} {v}" for k, v in found.items())
        + f" · model {model}"
    )
    return {
        "date": now.isoformat(), "command": command_line(sys.argv), "model": model, "eos_ids": list(eos_ids),
        "workload": args.workload, "concurrency": list(args.concurrency), "rounds": args.rounds,
        "params": dict(params), "servers": list(servers), "versions": found, "machine": box, "log_dir": log_dir,
        "workload_line": workload_line, "machine_line": machine_line,
    }
