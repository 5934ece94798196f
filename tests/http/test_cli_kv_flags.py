"""`mlx-trio serve --kv-bits/--kv-group-size/--quantized-kv-start`: mlx_lm.server's names, defaults and choices."""

from __future__ import annotations

import pytest

from mlx_trio.cli import build_parser, configs_from_args, main


def _engine(*argv: str):  # type: ignore[no-untyped-def]
    return configs_from_args(build_parser().parse_args(["serve", *argv]))[0]


def test_unset_is_bf16_with_mlx_lm_defaults() -> None:
    engine = _engine()
    assert (engine.kv_bits, engine.kv_group_size, engine.quantized_kv_start) == (None, 64, 5000)


def test_the_flags_reach_the_engine_config() -> None:
    engine = _engine("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0")
    assert (engine.kv_bits, engine.kv_group_size, engine.quantized_kv_start) == (4, 32, 0)


@pytest.mark.parametrize("argv", [["--kv-bits", "3"], ["--kv-bits", "16"], ["--kv-group-size", "48"],
                                  ["--quantized-kv-start", "-1"]])
def test_values_mlx_cannot_quantize_with_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2


@pytest.mark.parametrize("speculation", [["--prompt-lookup"], ["--draft-model", "some/draft"]])
def test_quantized_kv_composes_with_speculation(speculation: list[str]) -> None:
    """Quantized rows roll back exactly (engine/kv/row_rollback.py): the flags combine."""
    engine = _engine("--kv-bits", "8", *speculation)
    assert engine.kv_bits == 8 and (engine.prompt_lookup or engine.draft_model == "some/draft")
