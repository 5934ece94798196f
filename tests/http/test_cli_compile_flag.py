"""`mlx-trio serve --no-compile`: decode steps compile by default; the flag turns it off in EngineConfig."""

from __future__ import annotations

from mlx_trio.cli import build_parser, configs_from_args


def _engine(*argv: str):  # type: ignore[no-untyped-def]
    return configs_from_args(build_parser().parse_args(["serve", *argv]))[0]


def test_decode_compiles_by_default() -> None:
    assert _engine().compile_decode is True


def test_no_compile_reaches_the_engine_config() -> None:
    assert _engine("--no-compile").compile_decode is False
