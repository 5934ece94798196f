"""--kv-layout {auto,paged,padded} (docs/design.md §6.5): the pure rule, the config's refusals, the flag, and what
an engine on the CPU decides at load and reports in `/v1/status`."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.config import EngineConfig, choose_kv_layout
from mlx_trio.errors import ModelLoadError
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model

NO_KERNEL = "no paged decode kernel on this backend (cpu)"


async def _admitting(engine: Any) -> dict[str, Any]:
    """`engine.status()` once admission has its limits, so the prompt cache is made (or not) by then."""
    with trio.fail_after(10):
        while not engine.status()["counters"]["kv_budget_bytes"]:  # 0 until the limits arrive
            await trio.sleep(0.01)
    return engine.status()


# -- the rule: one pure function -------------------------------------------------------------

def test_auto_is_paged_when_every_input_allows_it() -> None:
    choice = choose_kv_layout("auto", [], None)
    assert choice.paged and choice.layout == "paged" and choice.reason.startswith("auto: ")


def test_auto_is_padded_without_a_paged_decode_kernel_and_says_how_to_force_blocks() -> None:
    choice = choose_kv_layout("auto", [], NO_KERNEL)
    assert not choice.paged and choice.layout == "padded"
    assert str(choice) == f"padded (auto: {NO_KERNEL}; --kv-layout paged forces blocks)"


def test_auto_is_padded_with_any_refusal_and_names_each() -> None:
    refusals = ["--kv-bits: quantized KV is not on the paged layout yet", "model m cannot hold paged KV: layer 0 ..."]
    choice = choose_kv_layout("auto", refusals, None)  # a kernel does not outweigh a refusal
    assert not choice.paged and choice.reason == f"auto: {refusals[0]}; {refusals[1]}"


def test_padded_is_padded_whatever_the_inputs() -> None:
    assert choose_kv_layout("padded", [], None) == choose_kv_layout("padded", ["x"], "y")
    assert not choose_kv_layout("padded", [], None).paged


def test_paged_is_paged_without_a_kernel_saying_auto_would_not_and_an_error_with_a_refusal() -> None:
    choice = choose_kv_layout("paged", [], NO_KERNEL)
    assert choice.paged and NO_KERNEL in choice.reason and "auto would not choose it" in choice.reason
    assert choose_kv_layout("paged", [], None).reason == "--kv-layout paged"
    with pytest.raises(ValueError, match=r"--kv-layout paged cannot serve here: --kv-bits: .*use --kv-layout auto"):
        choose_kv_layout("paged", ["--kv-bits: quantized KV is not on the paged layout yet"], None)
    with pytest.raises(ValueError, match="--kv-layout must be one of auto, paged, padded"):
        choose_kv_layout("blocks", [], None)


# -- the config and the flag -----------------------------------------------------------------

@pytest.mark.parametrize(("flags", "named"), [
    ({"kv_bits": 8}, "--kv-bits"), ({"draft_model": "x"}, "--draft-model"), ({"batch": 1}, "--batch 1")])
def test_paged_with_a_flag_it_cannot_serve_is_refused_naming_both_flags(flags: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"--kv-layout paged cannot serve here: {named}") as info:
        EngineConfig(model="m", kv_layout="paged", **flags)
    assert "--kv-layout auto" in str(info.value)  # what to change
    # auto takes the same flags quietly (padded, said at load); padded never looks.
    assert EngineConfig(model="m", **flags).paged_conflicts[0].startswith(named)
    EngineConfig(model="m", kv_layout="padded", **flags)


def test_paged_takes_an_ssd_tier() -> None:
    """The SSD tier stores blocks under paged KV (actors/block_persistence.py): no conflict."""
    assert EngineConfig(model="m", kv_layout="paged", prompt_cache_dir="/tmp/x").paged_conflicts == ()


def test_the_flag_parses_defaults_to_auto_and_replaces_paged_kv() -> None:
    from mlx_trio.cli import build_parser, configs_from_args

    assert configs_from_args(build_parser().parse_args(["serve"]))[0].kv_layout == "auto"
    engine, _ = configs_from_args(build_parser().parse_args(["serve", "--kv-layout", "paged"]))
    assert engine.kv_layout == "paged" and not engine.paged_conflicts
    for gone in (["--paged-kv"], ["--kv-layout", "blocks"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *gone])
    with pytest.raises(ValueError, match="--kv-layout paged cannot serve here: --kv-bits"):  # `serve` says it, exits
        configs_from_args(build_parser().parse_args(["serve", "--kv-layout", "paged", "--kv-bits", "8"]))


# -- an engine on the CPU ------------------------------------------------------------------------

async def test_auto_on_the_cpu_is_padded_and_status_says_why() -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=2) as engine:
        status = await _admitting(engine)
        counters = status["counters"]
        assert engine.actors.lane.model.paged_kv is None and counters["kv_blocks"] is None
        assert status["prompt_cache"]["enabled"] is True
    assert counters["kv_layout"] == "padded"
    assert counters["kv_layout_reason"] == f"auto: {NO_KERNEL}; --kv-layout paged forces blocks"


async def test_auto_with_a_flag_paged_refuses_is_padded_naming_the_flag() -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=1) as engine:
        await engine.wait_ready()
        assert engine.status()["counters"]["kv_layout_reason"].startswith("auto: --batch 1: ")


async def test_paged_on_the_cpu_runs_blocks_and_status_says_on_the_reference() -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=2, kv_layout="paged", kv_budget_bytes=16 << 20) as engine:
        await engine.wait_ready()
        counters = engine.status()["counters"]
        assert engine.actors.lane.model.paged_kv is not None and counters["kv_blocks"]["total"] > 0
    assert counters["kv_layout"] == "paged" and NO_KERNEL in counters["kv_layout_reason"]


async def test_paged_on_a_model_paged_refuses_is_a_start_up_error_naming_the_model_and_the_flag() -> None:
    with pytest.raises(ExceptionGroup) as info:  # open_engine's nursery wraps what wait_ready raised
        async with open_engine(str(tiny_model(LLAMA_SWA)), batch=2, kv_layout="paged"):
            pass
    assert info.group_contains(ModelLoadError, match=r"--kv-layout paged cannot serve here: model .* sliding-window"
                                                     r".*--kv-layout auto")


async def test_auto_on_a_model_paged_refuses_is_padded_naming_the_model() -> None:
    async with open_engine(str(tiny_model(LLAMA_SWA)), batch=2) as engine:
        await engine.wait_ready()
        reason = engine.status()["counters"]["kv_layout_reason"]
    assert reason.startswith("auto: model ") and "sliding-window" in reason


async def test_auto_where_a_paged_decode_kernel_passed_runs_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring of auto's last input: a backend whose paged kernel passed its self-check (as CUDA's does) gets
    the block pool, and the prompt cache gives way to its cached blocks."""
    from mlx_trio.actors import engine_tree

    monkeypatch.setattr(engine_tree, "paged_kernel_off", lambda model: None)
    async with open_engine(str(tiny_model(LLAMA)), batch=2, kv_budget_bytes=16 << 20) as engine:
        status = await _admitting(engine)
        counters = status["counters"]
        assert engine.actors.lane.model.paged_kv is not None and counters["kv_blocks"]["total"] > 0
        assert status["prompt_cache"]["enabled"] is False
    assert counters["kv_layout"] == "paged" and counters["kv_layout_reason"].startswith("auto: ")


def test_the_load_path_names_the_model_and_why_the_kernel_is_off() -> None:
    import attrs

    from mlx_trio.engine.model.load import load_model, paged_kernel_off, paged_refusals

    llama, swa = load_model(str(tiny_model(LLAMA))), load_model(str(tiny_model(LLAMA_SWA)))
    assert paged_refusals(llama) == () and paged_kernel_off(llama) == NO_KERNEL
    (refusal,) = paged_refusals(swa)
    assert refusal.startswith(f"model {swa.model_id} cannot hold paged KV: layer 0 is a sliding-window layer")
    # A GPU whose kernel install left off (its self-check failed, a float32 model) says so instead.
    off = attrs.evolve(llama, paged_kernel_off_reason="a float32 model")
    assert paged_kernel_off(off) == "the paged decode kernel is off: a float32 model"


def test_a_metal_kernel_that_passed_its_self_check_serves_paged_but_not_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """Metal's paged kernel has never been timed on a Mac: `auto` keeps the padded layout there (docs/design.md
    §6.5); the CUDA kernel, measured at par, lets `auto` choose blocks."""
    from types import SimpleNamespace

    from mlx_trio.engine.attention import routed_attention
    from mlx_trio.engine.model import load

    model = SimpleNamespace(model=object(), paged_kernel_off_reason=None)
    monkeypatch.setattr(routed_attention, "route_of", lambda m: SimpleNamespace(paged_decode=lambda *a: None))
    monkeypatch.setattr(routed_attention, "on_metal", lambda: True)
    off = load.paged_kernel_off(model)  # type: ignore[arg-type]
    assert off is not None and "not yet measured" in off
    assert not choose_kv_layout("auto", [], off).paged and choose_kv_layout("paged", [], off).paged
    monkeypatch.setattr(routed_attention, "on_metal", lambda: False)
    assert load.paged_kernel_off(model) is None  # type: ignore[arg-type]
