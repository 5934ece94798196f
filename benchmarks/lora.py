"""Per-row LoRA adapters: aggregate decode tok/s at B rows with 1, 2 and B distinct adapters vs the base (issue #24).

Usage:
    PYTHONPATH=$PWD python benchmarks/lora.py --tiny                 # CPU shape check, well under a minute
    python benchmarks/lora.py --model /tmp/mlx-trio-gpu-models/llama-1b --json lora-1b.json   # H200 (gpu.sh)

Writes `--adapters` random rank-`--rank` adapters on the q and v projections of
every layer (mlx-lm's adapter-directory format, float32 A and B as mlx-lm's
tuner saves them) next to the model, then, in one process and on the same
prompts (random ids, greedy, EOS banned so every row decodes exactly
`--max-tokens` tokens), runs B concurrent requests through:

* ``plain``    an engine without `lora_modules` (no wrapper in the model): the base alone;
* ``base``     the adapter engine, every row on the base model (wrappers installed, no row selects one);
* ``1 adapter`` every row on the same adapter (the one-slot path: mlx-lm's own LoRA arithmetic);
* ``2 adapters`` rows alternating between two (per-row gathered A and B);
* ``B adapters`` every row its own adapter;

and with ``--vs-mlx-lm`` the same cases through ``mlx_lm.server`` (its
`adapters` request field, `--decode-concurrency B`): it batches only requests
of one adapter, and switching reloads the model with the next adapter once
the running batch has drained.

Each case is warmed up once, then run `--repeats` times in turn (paired
rounds); the table shows the median aggregate tok/s (all generated tokens /
wall time from the first submit to the last token) and its ratio to ``plain``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from mlx_lm import load

from mlx_trio import open_engine
from mlx_trio.engine.adapters.adapter_files import linear_dims
from mlx_trio.events import Finished

KEYS = ("self_attn.q_proj", "self_attn.v_proj")


def write_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` random LoRA adapters of `rank` on q/v of every layer of the model at `model_dir`."""
    model, _ = load(str(model_dir))
    paths = []
    for n in range(count):
        path = out / f"adapter-{n}-r{rank}"
        paths.append(path)
        if (path / "adapters.safetensors").exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        mx.random.seed(n)
        weights = {}
        for i, layer in enumerate(model.layers):
            for key in KEYS:
                module = layer.self_attn.q_proj if key.endswith("q_proj") else layer.self_attn.v_proj
                in_dims, out_dims = linear_dims(module)
                bound = 1 / in_dims**0.5
                weights[f"model.layers.{i}.{key}.lora_a"] = mx.random.uniform(-bound, bound, (in_dims, rank))
                weights[f"model.layers.{i}.{key}.lora_b"] = 0.01 * mx.random.normal((rank, out_dims))
        mx.save_safetensors(str(path / "adapters.safetensors"), weights)
        config = {"fine_tune_type": "lora", "num_layers": len(model.layers),
                  "lora_parameters": {"rank": rank, "scale": 20.0, "dropout": 0.0, "keys": list(KEYS)}}
        (path / "adapter_config.json").write_text(json.dumps(config))
    return paths


async def run_rows(engine: Any, prompts: list[list[int]], models: list[str | None], max_tokens: int) -> float:
    """Aggregate tok/s of one request per prompt, all at once, each on its model (None: the base)."""
    bias = {e: -100.0 for e in engine.model.eos_token_ids}
    counts: list[int] = []
    start = time.perf_counter()
    end = start

    async def one(prompt: list[int], model: str | None) -> None:
        nonlocal end
        async for event in engine.generate(prompt, model=model, max_tokens=max_tokens, logit_bias=bias):
            if isinstance(event, Finished):
                counts.append(event.usage.completion_tokens)
                end = max(end, time.perf_counter())

    async with trio.open_nursery() as nursery:
        for prompt, model in zip(prompts, models, strict=True):
            nursery.start_soon(one, prompt, model)
    assert counts == [max_tokens] * len(prompts), counts
    return sum(counts) / (end - start)


async def measure(args: argparse.Namespace, model_dir: Path, adapters: list[Path]) -> dict[str, list[float]]:
    B = args.batch
    prompts = [[10 + (7 * b + 3 * j) % 400 for j in range(args.prompt_tokens)] for b in range(B)]
    names = [f"a{n}" for n in range(len(adapters))]
    cases = {"base": [None] * B, "1 adapter": [names[0]] * B, "2 adapters": [names[i % 2] for i in range(B)],
             f"{B} adapters": [names[i % len(names)] for i in range(B)]}
    modules = {name: str(path) for name, path in zip(names, adapters, strict=True)}
    # Both engines open at once, their cases run in turn each round: drift hits them alike.
    async with open_engine(str(model_dir), batch=B) as plain, \
            open_engine(str(model_dir), batch=B, lora_modules=modules, max_loras=len(names),
                        max_lora_rank=args.rank) as lora:
        runs = [("plain", plain, [None] * B), *((case, lora, models) for case, models in cases.items())]
        for _, engine, models in runs:
            await run_rows(engine, prompts, models, args.max_tokens)  # warm-up (and the adapters' slots)
        results: dict[str, list[float]] = {case: [] for case, _, _ in runs}
        for _ in range(args.repeats):
            for case, engine, models in runs:
                results[case].append(await run_rows(engine, prompts, models, args.max_tokens))
    return results


def mlx_lm_server_rates(args: argparse.Namespace, model_dir: Path, adapters: list[Path]) -> dict[str, list[float]]:
    """The cases through `mlx_lm.server` over HTTP (B concurrent /v1/completions requests)."""
    import socket  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    import httpx  # noqa: PLC0415

    B = args.batch
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port),
                               "--decode-concurrency", str(B)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                httpx.get(f"{url}/v1/models", timeout=1.0)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        _, tokenizer = load(str(model_dir))
        bias = {str(e): -100.0 for e in tokenizer.eos_token_ids}
        # Text prompts (its completions take no token ids), decoded from the engine cases' ids.
        prompts = [tokenizer.decode([10 + (7 * b + 3 * j) % 400 for j in range(args.prompt_tokens)]) for b in range(B)]
        paths = [str(p) for p in adapters]
        cases = {"base": [None] * B, "1 adapter": [paths[0]] * B, "2 adapters": [paths[i % 2] for i in range(B)],
                 f"{B} adapters": [paths[i % len(paths)] for i in range(B)]}

        async def one(client: httpx.AsyncClient, prompt: str, adapter: str | None, counts: list[int]) -> None:
            # `model` given: mlx_lm.server ignores `adapters` for its "default_model".
            body = {"model": str(model_dir), "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "logit_bias": bias,
                    **({"adapters": adapter} if adapter else {})}
            response = await client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            counts.append(response.json()["usage"]["completion_tokens"])

        async def rate(models: list[str | None]) -> float:
            counts: list[int] = []
            async with httpx.AsyncClient(timeout=600) as client:
                start = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for prompt, adapter in zip(prompts, models, strict=True):
                        nursery.start_soon(one, client, prompt, adapter, counts)
                return sum(counts) / (time.perf_counter() - start)

        results: dict[str, list[float]] = {}
        for case, models in cases.items():
            trio.run(rate, models)  # warm-up
            results[f"mlx_lm.server, {case}"] = [trio.run(rate, models) for _ in range(args.mlx_lm_repeats)]
        return results
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama (CPU shape check)")
    parser.add_argument("--model", type=Path, default=Path("/tmp/mlx-trio-gpu-models/llama-1b"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=None, help="distinct adapters (default: --batch)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 256 (32 with --tiny)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--vs-mlx-lm", action="store_true", help="also through mlx_lm.server (adapter switching)")
    parser.add_argument("--mlx-lm-repeats", type=int, default=1)
    args = parser.parse_args()
    args.adapters = args.adapters or args.batch
    if args.tiny:
        from mlx_trio.testing.tiny_models import LLAMA, tiny_model  # noqa: PLC0415

        args.model = Path(tiny_model(LLAMA))
        args.max_tokens = args.max_tokens or 32
    args.max_tokens = args.max_tokens or 256
    adapters = write_adapters(args.model, args.model.parent / f"{args.model.name}-lora-adapters", args.adapters,
                              args.rank)
    results = trio.run(measure, args, args.model, adapters)
    report(args, results)  # now, so a run cut short in the mlx_lm.server part still has it
    if args.vs_mlx_lm:
        results.update(mlx_lm_server_rates(args, args.model, adapters))
        report(args, results)


def report(args: argparse.Namespace, results: dict[str, list[float]]) -> None:
    """Print the table (median tok/s, ratio to plain) and write `--json`."""
    plain = statistics.median(results["plain"])
    print(f"\n### per-row LoRA, {args.model.name}: B={args.batch}, rank-{args.rank} q/v adapters, "
          f"{args.prompt_tokens}-token prompts, {args.max_tokens} decode tokens, {mx.default_device()}\n")
    print("| rows use | tok/s (median) | vs plain |\n|---|---|---|")
    for case, rates in results.items():
        print(f"| {case} | {statistics.median(rates):.1f} | {statistics.median(rates) / plain:.2f}× |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"model": str(args.model), "batch": args.batch, "rank": args.rank,
                                         "max_tokens": args.max_tokens, "device": str(mx.default_device()),
                                         "results": results}, indent=1))

if __name__ == "__main__":
    main()
