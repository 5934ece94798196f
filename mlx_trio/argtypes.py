"""Value types for argparse flags, shared by `mlx-trio serve` and `mlx-trio bench`.

Each raises `argparse.ArgumentTypeError`, which argparse turns into a usage
error naming the flag.
"""

from __future__ import annotations

import argparse
import re

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def size(text: str) -> int:
    """Bytes as mlx_lm.server writes them (`8GB`, `512M`: decimal units), or binary units (`512MiB`)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB, 512MiB or 1000000, got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value
