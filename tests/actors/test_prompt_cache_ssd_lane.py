"""The prompt cache's SSD tier through the embeddable API: survives a restart, shrugs off bad files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mlx_trio import open_engine
from mlx_trio.events import Finished, TextDelta
from mlx_trio.testing.tiny_models import LLAMA, LLAMA_SWA, tiny_model

SYSTEM = "You are a careful agent. Read the sea story and answer in plain words. " * 20
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the ship."}]


async def _run(engine, prompt=CHAT) -> tuple[tuple[int, ...], Finished]:
    ids: list[int] = []
    async for event in engine.generate(prompt, max_tokens=8):
        if isinstance(event, TextDelta):
            ids.extend(event.token_ids)
        elif isinstance(event, Finished):
            return tuple(ids), event
    raise AssertionError("no Finished event")


async def _first_run(spec, directory: Path) -> tuple[int, ...]:
    async with open_engine(str(tiny_model(spec)), batch=4, prompt_cache_dir=directory) as engine:
        ids, finished = await _run(engine)
        assert finished.usage.cached_tokens == 0
        await engine.drain_persistence()
        ssd = engine.status()["prompt_cache"]["ssd"]
    assert ssd["enabled"] and ssd["writes"] >= 1 and not ssd["degraded"]
    return ids


@pytest.mark.parametrize("spec", [LLAMA, LLAMA_SWA], ids=["full", "rotating"])
async def test_a_restarted_server_serves_the_first_request_from_the_ssd_entry(tmp_path: Path, spec) -> None:
    cold = await _first_run(spec, tmp_path)
    async with open_engine(str(tiny_model(spec)), batch=4, prompt_cache_dir=tmp_path) as engine:
        ids, finished = await _run(engine)
        stats = engine.status()["prompt_cache"]
    assert ids == cold
    assert finished.usage.cached_tokens > 500 and stats["ssd"]["reads"] == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign-model"])
async def test_damaged_entry_files_are_skipped_and_removed(tmp_path: Path, damage: str) -> None:
    cold = await _first_run(LLAMA, tmp_path)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files
    damaged = {}
    for path in files:
        data = path.read_bytes()
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "flip":
            data = data[:-64] + bytes(b ^ 0xFF for b in data[-64:])
        path.write_bytes(data)
        damaged[path] = data
    model = LLAMA if damage != "foreign-model" else LLAMA_SWA  # another model's server on the same directory
    async with open_engine(str(tiny_model(model)), batch=4, prompt_cache_dir=tmp_path) as engine:
        ids, finished = await _run(engine)
        stats = engine.status()["prompt_cache"]
    if model is LLAMA:
        assert ids == cold
    assert finished.usage.cached_tokens == 0 and stats["ssd"]["reads"] == 0
    # Removed (the server may since have written a good entry under the same name).
    assert all(not path.exists() or path.read_bytes() != data for path, data in damaged.items())


async def test_a_directory_removed_mid_run_degrades_to_ram_only(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prompt_cache_dir=directory) as engine:
        cold, _ = await _run(engine)
        await engine.drain_persistence()
        shutil.rmtree(directory)
        (tmp_path / "cache").write_text("not a directory")  # and nothing can recreate it
        other = [{"role": "system", "content": SYSTEM + " More."}, {"role": "user", "content": "Go."}]
        _, finished = await _run(engine, other)
        await engine.drain_persistence()
        again, cached = await _run(engine)
        stats = engine.status()["prompt_cache"]
        ok, _ = engine.health()
    assert finished.finish_reason in ("stop", "length") and again == cold and ok
    assert cached.usage.cached_tokens > 500  # the RAM tier still serves
    assert stats["ssd"]["degraded"] or stats["ssd"]["errors"] >= 1
