"""Benchmark models: random-weight Llamas of real shapes, and model copies that never stop early.

A benchmark needs a real model's dimensions (its step time) but not its
weights, and it needs every row to generate exactly `max_tokens` tokens. So
`build_shape` writes a random bf16 Llama of a named shape (Llama-3.2-1B,
Llama-3.1-8B) with the tiny model's tokenizer, and `no_eos_copy` makes a
copy of any model directory whose configs declare no EOS token (weights
symlinked). `resolve_model` is the choice the benchmark scripts offer on
their command line (`--shape`, `--model`, `--num-layers`).

MLX work runs on a throwaway thread that releases its streams before it
ends (`run_in_mlx_thread`; why: docs/gpu-lease.md), so the caller's thread
stays MLX-free.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B dimensions.
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, head_dim=64,
                     rope_theta=500000.0, max_position_embeddings=131072,
                     rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    # Llama-3.1-8B dimensions.
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, head_dim=128,
                     rope_theta=500000.0, max_position_embeddings=131072,
                     rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
}


def run_in_mlx_thread(fn: Callable[[], Any]) -> Any:
    """Run MLX work on a throwaway thread that releases its streams; the main thread stays MLX-free."""
    from mlx_trio.engine.lease_thread import release_thread_streams

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller
            box["error"] = exc
        finally:
            release_thread_streams()

    thread = threading.Thread(target=target, name="mlx-build")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def tiny_tokenizer_dir() -> Path:
    """The tiny Llama (`mlx_trio.testing.tiny_models.LLAMA`): its tokenizer files serve every shape."""
    from mlx_trio.testing.tiny_models import LLAMA, tiny_model

    return tiny_model(LLAMA)


def build_shape(shape: str, out_dir: Path, num_layers: int | None) -> Path:
    """A random-weight bf16 Llama of `shape` with the tiny model's tokenizer files."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    dims = dict(SHAPES[shape])
    if num_layers:
        dims["num_hidden_layers"] = num_layers
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
              "torch_dtype": "bfloat16", **dims}
    out_dir.mkdir(parents=True, exist_ok=True)

    def build() -> None:
        mx.random.seed(0)
        model = llama.Model(llama.ModelArgs.from_dict(config))
        model.set_dtype(mx.bfloat16)
        weights = dict(tree_flatten(model.parameters()))
        mx.eval(weights)
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})

    t0 = time.perf_counter()
    run_in_mlx_thread(build)
    src = tiny_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, out_dir / name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"# built random {shape} ({dims['num_hidden_layers']} layers, bf16) in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return out_dir


def no_eos_copy(src: Path, dst: Path) -> Path:
    """`src` with every EOS declaration removed (weights symlinked), so generation runs to max_tokens."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name.startswith("."):
            continue
        target = dst / item.name
        if item.suffix != ".json":
            os.symlink(item.resolve(), target)
            continue
        data = json.loads(item.read_text())
        if item.name in ("config.json", "generation_config.json"):
            data.pop("eos_token_id", None)
            for sub in ("text_config",):
                if isinstance(data.get(sub), dict):
                    data[sub].pop("eos_token_id", None)
        elif item.name in ("tokenizer_config.json", "special_tokens_map.json"):
            data.pop("eos_token", None)
            if item.name == "tokenizer_config.json":
                data["eos_token"] = None
        target.write_text(json.dumps(data, indent=2) + "\n")
    return dst


def resolve_model(workdir: Path, *, shape: str | None, model: str | None,
                  num_layers: int | None) -> tuple[Path, str]:
    """The benchmark's model, as a no-EOS copy under `workdir`, and a label for its report.

    `shape` ("tiny" or a key of `SHAPES`) wins over `model` (a directory, or
    None / "default" for SmolLM2-135M); `num_layers` overrides a shape's depth.
    """
    if shape == "tiny":
        src, label = tiny_tokenizer_dir(), "tiny llama (random, f32, 2x64, vocab 512)"
    elif shape:
        src = build_shape(shape, workdir / "weights", num_layers)
        layers = num_layers or SHAPES[shape]["num_hidden_layers"]
        label = f"{shape} shape (random weights, bf16, {layers} layers)"
    elif model in (None, "default"):
        from mlx_trio.engine.model.default_model import ensure_default_model

        src, label = Path(ensure_default_model()), "SmolLM2-135M-Instruct (Q4_1 GGUF -> mlx 4-bit)"
    else:
        src, label = Path(model).expanduser().resolve(), model
    return no_eos_copy(src, workdir / "model"), label
