"""`mlx-trio bench`: a stack-vs-stack load generator for OpenAI-compatible servers.

It speaks HTTP only (httpx streaming SSE) and starts servers as subprocesses, so
this package never imports mlx and measures any OpenAI-compatible server alike:

| file | job |
|---|---|
| `workloads.py` | deterministic sessions for a seed: agents, uniform, long-prompt, agent-loop, serving, long-context |
| `client.py` | one streamed chat completion, timed (TTFT, inter-chunk gaps, e2e, usage) |
| `runner.py` | one workload against one server at one concurrency; A B A B over servers |
| `metrics.py` | percentiles, wall-clock throughput, per-run summaries, ratios |
| `long_context.py` | the long-context report: TTFT p50/p90/p99, prefill tok/s under load, the rate sweep |
| `servers.py` | start and stop `mlx-trio serve` / `mlx_lm.server` on free loopback ports |
| `model_info.py` | EOS ids read from a model directory's JSON files |
| `progress.py` | a progress bar (rich, else tqdm, else none) |
| `report.py` | the markdown table, the JSON document, the optional PNG |
| `meta.py` | machine, date, versions and command, recorded with every result |
| `cli.py` | the `bench` subcommand's flags and `run(args)` (imports no HTTP client until it runs) |
| `orchestrate.py` | start servers, warm up, run the matrix, print and write the report, stop servers |
"""
