"""The layering rules of docs/architecture.md, checked on the source's import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_trio"


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(subpackage: str) -> list[Path]:
    return sorted((PACKAGE / subpackage).rglob("*.py"))


def _top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("path", _files("engine"), ids=lambda p: p.name)
def test_engine_never_imports_trio(path: Path) -> None:
    """engine/ is synchronous MLX mechanics: no module there imports trio."""
    assert not {n for n in _imported_modules(path) if _top(n) in {"trio", "quart_trio", "hypercorn"}}


@pytest.mark.parametrize(
    "path", _files("actors") + _files("http") + _files("supervision"), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_actors_http_supervision_never_import_mlx(path: Path) -> None:
    """Every MLX call goes through the GPU lease, so these layers never import mlx or mlx_lm."""
    assert not {n for n in _imported_modules(path) if _top(n) in {"mlx", "mlx_lm"}}


@pytest.mark.parametrize("path", _files("supervision") + _files("http"), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_supervision_and_http_never_import_engine(path: Path) -> None:
    """Supervision is generic and HTTP is a client of the embeddable API: neither reaches into engine/."""
    assert not {n for n in _imported_modules(path) if n.startswith("mlx_trio.engine")}


def test_the_architecture_checks_see_files() -> None:
    """Guard against the parametrized checks silently running over nothing."""
    assert len(_files("engine")) >= 5 and len(_files("actors")) >= 3
