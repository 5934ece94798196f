"""Random LoRA / DoRA adapters written as mlx-lm adapter directories, with mlx-lm's own tuner code.

`write_adapter` loads the base model, converts its layers with mlx-lm's
`linear_to_lora_layers` (exactly what `mlx_lm.lora` trains), gives `lora_b`
(zeros at init, which would leave the output unchanged) seeded random values
large enough to change greedy tokens, and saves `adapters.safetensors` and
`adapter_config.json` as the tuner does. The oracle is then mlx-lm's
`load(model, adapter_path=...)`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.tuner.utils import linear_to_lora_layers

# The tuner's default target of Llama-like models when keys are given: attention query and value.
QV_KEYS = ("self_attn.q_proj", "self_attn.v_proj")


def write_adapter(base: str | Path, out_dir: str | Path, *, seed: int, rank: int = 8, scale: float = 20.0,
                  keys: Sequence[str] = QV_KEYS, num_layers: int = -1, dora: bool = False,
                  b_std: float = 0.05) -> Path:
    """Write a random adapter for the model at `base` into `out_dir`; return it.

    `num_layers` counts blocks from the last (-1: all, as mlx-lm's tuner takes it).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, _ = load(str(base))
    lora_parameters = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}
    layers = len(model.layers) if num_layers < 0 else num_layers
    mx.random.seed(seed)
    linear_to_lora_layers(model, layers, lora_parameters, use_dora=dora)
    params = dict(tree_flatten(model.parameters()))
    weights = {}
    for name, value in params.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lora_b":
            value = b_std * mx.random.normal(value.shape, dtype=value.dtype)
        elif leaf == "m":
            value = value * (1.0 + 0.1 * mx.random.normal(value.shape, dtype=value.dtype))
        if leaf in ("lora_a", "lora_b", "m"):
            weights[name] = value
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "dora" if dora else "lora", "num_layers": layers,
              "lora_parameters": lora_parameters}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
