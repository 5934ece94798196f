"""goldens/tiny.json, mlx-lm's own outputs (written only by scripts/make_goldens.py), for the tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GOLDENS: dict[str, Any] = json.loads((Path(__file__).resolve().parents[1] / "goldens" / "tiny.json").read_text())


def golden(model: str, name: str) -> dict[str, Any]:
    """The case `name` of tiny model `model`."""
    return next(c for c in GOLDENS["cases"] if c["model"] == model and c["name"] == name)
