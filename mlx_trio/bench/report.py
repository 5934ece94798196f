"""The bench's outputs: a markdown table (stdout), a JSON document, an optional PNG.

The table has one row per server per concurrency, then a ratio row comparing
the first server with each other one (first/other: above 1 is better for the
first server on tok/s, below 1 on latencies). Latencies are shown in ms.
matplotlib is imported only when a plot is asked for, and a missing one skips
the plot with a message instead of failing the bench.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from mlx_trio.bench.client import RequestResult
from mlx_trio.bench.metrics import Summary, ratios
from mlx_trio.bench.runner import RunRecord

_LATENCY_COLUMNS = (("TTFT p50", "ttft_p50_s"), ("TTFT p95", "ttft_p95_s"), ("TTFT p99", "ttft_p99_s"),
                    ("ITL p50", "itl_p50_s"), ("ITL p95", "itl_p95_s"), ("TPOT p50", "tpot_p50_s"),
                    ("e2e p50", "e2e_p50_s"),
                    ("e2e p95", "e2e_p95_s"))
# Latencies below this (shown as 0 ms) get no ratio in the table.
MIN_RATIO_DENOMINATOR_S = 0.0005
_LONG_PROMPT_COLUMNS = (("stall max", "decode_stall_s"), ("long TTFT", "long_ttft_s"))
_AGENT_LOOP_COLUMNS = (("prefill stall", "prefill_stall_s"),)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f}"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def markdown_table(summaries: Sequence[Summary]) -> str:
    """One row per (concurrency, server) in run order, plus first/other ratio rows per concurrency."""
    servers = list(dict.fromkeys(s.server for s in summaries))
    long_prompt = any(s.decode_stall_s is not None or s.long_ttft_s is not None for s in summaries)
    agent_loop = any(s.cached_fraction_by_turn for s in summaries)
    latency = (_LATENCY_COLUMNS + (_LONG_PROMPT_COLUMNS if long_prompt else ())
               + (_AGENT_LOOP_COLUMNS if agent_loop else ()))
    gpu = any(s.gpu_busy_percent is not None for s in summaries)
    header = ["conc", "server", "ok/failed", *(f"{name} ms" for name, _ in latency), "out tok/s",
              "cached/prompt tok", *(["GPU busy %"] if gpu else [])]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    by_key = {(s.concurrency, s.server): s for s in summaries}
    for concurrency in dict.fromkeys(s.concurrency for s in summaries):
        for server in servers:
            s = by_key.get((concurrency, server))
            if s is None:
                continue
            died = " (died)" if s.server_died else ""
            tok_s = "–" if s.output_tok_s is None else f"{s.output_tok_s:.1f}"
            cells = [str(concurrency), server + died, f"{s.num_ok}/{s.num_failed}",
                     *(_ms(getattr(s, field)) for _, field in latency), tok_s, f"{s.cached_tokens}/{s.prompt_tokens}",
                     *([_percent(s.gpu_busy_percent)] if gpu else [])]
            lines.append("| " + " | ".join(cells) + " |")
        first = by_key.get((concurrency, servers[0]))
        for other in servers[1:]:
            b = by_key.get((concurrency, other))
            if first is None or b is None:
                continue
            r = ratios(first, b)
            # A latency shown as 0 ms (chunks that arrived together) would make a meaningless ratio.
            shown = {field: r.get(field) if (getattr(b, field) or 0) >= MIN_RATIO_DENOMINATOR_S else None
                     for _, field in latency}
            cells = [str(concurrency), f"**{servers[0]}/{other}**", "",
                     *(_x(shown[field]) for _, field in latency), _x(r["output_tok_s"]), "", *([""] if gpu else [])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(summaries: Sequence[Summary]) -> str:
    """Failures by message, servers that died, and outputs that stopped before max_tokens."""
    out = []
    for s in summaries:
        for message, count in s.errors:
            out.append(f"- {s.server} c={s.concurrency}: {count} × {message}")
        if s.server_died:
            out.append(f"- {s.server} c={s.concurrency}: the server process died during a run")
        if s.cached_fraction_by_turn:
            shown = " ".join("–" if f is None else f"{f:.2f}" for f in s.cached_fraction_by_turn)
            out.append(f"- {s.server} c={s.concurrency}: cached fraction by turn: {shown}")
        if s.num_stopped_early:
            out.append(f"- {s.server} c={s.concurrency}: {s.num_stopped_early} outputs ended before max_tokens "
                       "(EOS not suppressed? pass --eos-id)")
    return "\n".join(out)


def document(summaries: Sequence[Summary], records: Sequence[RunRecord], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON document: metadata, summaries, ratios, and every request's measurements."""
    servers = list(dict.fromkeys(s.server for s in summaries))
    by_key = {(s.concurrency, s.server): s for s in summaries}
    ratio_rows = [
        {"concurrency": c, "a": servers[0], "b": other, **ratios(by_key[(c, servers[0])], by_key[(c, other)])}
        for c in dict.fromkeys(s.concurrency for s in summaries) for other in servers[1:]
        if (c, servers[0]) in by_key and (c, other) in by_key
    ]
    return {
        "meta": dict(meta),
        "summaries": [attrs.asdict(s) for s in summaries],
        "ratios": ratio_rows,
        "runs": [
            {"server": r.server, "concurrency": r.concurrency, "round": r.round, "server_died": r.server_died,
             "gpu_busy_percent": r.gpu_busy_percent, "rate_per_s": r.rate_per_s,
             "requests": [attrs.asdict(x, filter=lambda a, _: a.name != "text") for x in r.results]}
            for r in records
        ],
    }


def records_from_document(doc: Mapping[str, Any]) -> list[RunRecord]:
    """The runs of a document written by `document` (generated text is not kept, so it comes back empty)."""
    records = []
    for run in doc["runs"]:
        results = tuple(RequestResult(**{**r, "itl_s": tuple(r["itl_s"])}) for r in run["requests"])
        records.append(RunRecord(run["server"], run["concurrency"], run["round"], results,
                                 server_died=run["server_died"], gpu_busy_percent=run.get("gpu_busy_percent"),
                                 rate_per_s=run.get("rate_per_s")))
    return records


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")


def write_plot(path: Path, summaries: Sequence[Summary], title: str) -> bool:
    """TTFT p50 and throughput against concurrency, one line per server; False (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("mlx-trio bench: matplotlib is not installed (pip install 'mlx-trio[bench]'); no plot written",
              file=sys.stderr)
        return False
    fig, (ax_ttft, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    for server in dict.fromkeys(s.server for s in summaries):
        mine = sorted((s for s in summaries if s.server == server), key=lambda s: s.concurrency)
        xs = [s.concurrency for s in mine]
        ax_ttft.plot(xs, [None if s.ttft_p50_s is None else s.ttft_p50_s * 1000 for s in mine], marker="o",
                     label=server)
        ax_tps.plot(xs, [s.output_tok_s for s in mine], marker="o", label=server)
    for ax, ylabel in ((ax_ttft, "TTFT p50 (ms)"), (ax_tps, "output tok/s (wall clock)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
