"""`mlx-trio serve --no-compile`: decode steps compile by default where measured (the CPU); the flag turns it off."""

from __future__ import annotations

import mlx.core as mx

from mlx_trio.cli import build_parser, configs_from_args
from mlx_trio.engine.batch.compiled_step import compile_wanted


def _engine(*argv: str):  # type: ignore[no-untyped-def]
    return configs_from_args(build_parser().parse_args(["serve", *argv]))[0]


def test_decode_compiles_by_default_on_the_cpu_only() -> None:
    assert _engine().compile_decode is None
    assert compile_wanted(None) is (mx.default_device() != mx.gpu)


def test_no_compile_reaches_the_engine_config() -> None:
    assert _engine("--no-compile").compile_decode is False
    assert compile_wanted(False) is False
