"""Read an mlx-lm adapter directory into per-layer arrays, checked against the base model's shapes.

An adapter directory is what mlx-lm's tuner writes (`mlx_lm.lora --adapter-path`):
`adapter_config.json` (`fine_tune_type` "lora" or "dora", `lora_parameters`
with `rank` and `scale`) and `adapters.safetensors`, whose names are the
model's own parameter paths: `<module>.lora_a` `[in, r]`, `<module>.lora_b`
`[r, out]` and, for DoRA, `<module>.m` `[out]`. The tensor names say which
modules an adapter touches, so we read them instead of re-deriving mlx-lm's
`keys`/`num_layers` rule. Nothing here changes the model.

Runs on the lease thread (it makes MLX arrays).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import attrs
import mlx.core as mx
import mlx.nn as nn

from mlx_trio.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
_KINDS = ("lora", "dora")
_LEAVES = ("lora_a", "lora_b", "m")


@attrs.frozen
class LayerDelta:
    """One module's low-rank update: `a` `[in, r]`, `b` `[r, out]`, DoRA's magnitude `m` `[out]` (None for LoRA)."""

    a: mx.array = attrs.field(eq=False, repr=False)
    b: mx.array = attrs.field(eq=False, repr=False)
    m: mx.array | None = attrs.field(eq=False, repr=False, default=None)


@attrs.frozen
class AdapterWeights:
    """An adapter read from its directory: what it changes and how much (`scale`), and a revision of its files."""

    name: str
    path: str
    kind: str  # "lora" or "dora"
    rank: int
    scale: float
    # Module path in the base model ("model.layers.3.self_attn.q_proj") -> its update.
    layers: Mapping[str, LayerDelta] = attrs.field(eq=False, repr=False)
    # sha256 of the config and the weights: a retrained adapter under the same name is another revision.
    revision: str = ""

    @property
    def dora(self) -> bool:
        return self.kind == "dora"


def read_adapter(name: str, path: str | Path, model: nn.Module | Mapping[str, nn.Module], *,
                 max_rank: int) -> AdapterWeights:
    """The adapter at `path`, served as `name`; raises `AdapterError` naming the adapter and what is wrong.

    Checked against `model` (or its modules by path, as the base model has
    them): every module it names exists and is a (quantized)
    `Linear`, and every tensor has the shape that module needs; its rank is at
    most `max_rank` (the resident slots are sized by it).
    """
    root = Path(path)
    config = _read_config(name, root)
    kind = config.get("fine_tune_type", "lora")
    if kind not in _KINDS:
        raise AdapterError(f"adapter {name!r} ({root}): fine_tune_type {kind!r} is not served (only LoRA and DoRA)")
    params = config.get("lora_parameters") or {}
    try:
        rank, scale = int(params["rank"]), float(params["scale"])
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"adapter {name!r} ({root}): lora_parameters needs a numeric rank and scale") from None
    if not 0 < rank <= max_rank:
        raise AdapterError(f"adapter {name!r} ({root}): rank {rank} is over --max-lora-rank {max_rank}")
    try:
        tensors = mx.load(str(root / WEIGHTS_FILE))
    except Exception as exc:
        raise AdapterError(f"adapter {name!r} ({root}): cannot read {WEIGHTS_FILE}: {exc}") from exc
    modules = dict(model.named_modules()) if isinstance(model, nn.Module) else model
    grouped: dict[str, dict[str, mx.array]] = {}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in _LEAVES:
            raise AdapterError(f"adapter {name!r} ({root}): {key} is not a LoRA tensor")
        grouped.setdefault(module, {})[leaf] = value
    if not grouped:
        raise AdapterError(f"adapter {name!r} ({root}): {WEIGHTS_FILE} holds no tensors")
    layers = {module: _layer(name, root, module, parts, modules.get(module), rank, kind == "dora")
              for module, parts in sorted(grouped.items())}
    mx.eval([[d.a, d.b] + ([d.m] if d.m is not None else []) for d in layers.values()])
    return AdapterWeights(name, str(root), kind, rank, scale, layers, _revision(root))


def _read_config(name: str, root: Path) -> dict:
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r} ({root}): cannot read {CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r} ({root}): {CONFIG_FILE} is not an object")
    return config


def linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a `Linear` or `QuantizedLinear`, None for anything else."""
    if isinstance(module, nn.QuantizedLinear):
        out_dims, packed = module.weight.shape
        return packed * 32 // module.bits, out_dims
    if isinstance(module, nn.Linear):
        out_dims, in_dims = module.weight.shape
        return in_dims, out_dims
    return None


def _layer(name: str, root: Path, module: str, parts: dict[str, mx.array], base: nn.Module | None, rank: int,
           dora: bool) -> LayerDelta:
    where = f"adapter {name!r} ({root}), layer {module}"
    dims = linear_dims(base) if base is not None else None
    if dims is None:
        what = "does not exist in the base model" if base is None else f"is a {type(base).__name__}, not a Linear"
        raise AdapterError(f"{where}: {what}")
    in_dims, out_dims = dims
    expected = {"lora_a": (in_dims, rank), "lora_b": (rank, out_dims)} | ({"m": (out_dims,)} if dora else {})
    for leaf, shape in expected.items():
        if leaf not in parts:
            raise AdapterError(f"{where}: {leaf} is missing")
        if tuple(parts[leaf].shape) != shape:
            raise AdapterError(f"{where}: {leaf} has shape {tuple(parts[leaf].shape)}, the base model needs {shape}")
    if not dora and "m" in parts:
        raise AdapterError(f"{where}: a DoRA magnitude in a LoRA adapter (fine_tune_type is not 'dora')")
    return LayerDelta(parts["lora_a"], parts["lora_b"], parts.get("m"))


def _revision(root: Path) -> str:
    h = hashlib.sha256()
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(f"\0{file}\0".encode())
        h.update((root / file).read_bytes())
    return h.hexdigest()
