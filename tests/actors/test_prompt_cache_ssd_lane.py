"""The prompt cache's SSD tier through the embeddable API: survives a restart, shrugs off bad files."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from safetensors import safe_open

from mlx_trio import open_engine
from mlx_trio.engine.prompt_cache.host_entry import CLASSES, STATES, HostEntry
from mlx_trio.engine.prompt_cache.identity import CacheIdentity
from mlx_trio.engine.prompt_cache.ssd_files import SUFFIX, CacheFileStore
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


async def _first_run(spec, directory: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The first server's greedy tokens for CHAT and CHAT's prompt ids, its SSD entries written."""
    async with open_engine(str(tiny_model(spec)), batch=4, prompt_cache_dir=directory) as engine:
        prompt = engine.prepare(CHAT).prompt_ids
        ids, finished = await _run(engine)
        assert finished.usage.cached_tokens == 0
        await engine.drain_persistence()
        ssd = engine.status()["prompt_cache"]["ssd"]
    assert ssd["enabled"] and ssd["writes"] >= 1 and not ssd["degraded"]
    _keep_only_the_prompt_entry(directory, prompt)
    return ids, prompt


def _keep_only_the_prompt_entry(directory: Path, prompt: tuple[int, ...]) -> tuple[CacheFileStore, Any]:
    """Remove every SSD entry but the boundary snapshot a lookup of `prompt` reads; returns the store and its info.

    The first run also stores a finish-time entry (prompt + answer, no prefix of the prompt) when it
    lives one decode step past its `Finished`: it always does since the engine waits for its pools to go
    idle at close, before that only by timing. The tests here damage or swap the one entry a lookup reads.
    """
    with safe_open(next(directory.glob(f"*{SUFFIX}")), framework="numpy") as f:
        identity = CacheIdentity.from_metadata(f.metadata())
    store = CacheFileStore(directory, max_bytes=2**30, identity=identity)
    stored = store.scan()
    info = store.longest_prefix(prompt, max_len=len(prompt) - 1)
    assert info is not None
    for other in stored:
        if other.key != info.key:
            store.remove(other.key)
    return store, info


@pytest.mark.parametrize("spec", [LLAMA, LLAMA_SWA], ids=["full", "rotating"])
async def test_a_restarted_server_serves_the_first_request_from_the_ssd_entry(tmp_path: Path, spec) -> None:
    cold, _ = await _first_run(spec, tmp_path)
    async with open_engine(str(tiny_model(spec)), batch=4, prompt_cache_dir=tmp_path) as engine:
        ids, finished = await _run(engine)
        stats = engine.status()["prompt_cache"]
    assert ids == cold
    assert finished.usage.cached_tokens > 500 and stats["ssd"]["reads"] == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign-model"])
async def test_damaged_entry_files_are_skipped_and_removed(tmp_path: Path, damage: str) -> None:
    cold, _ = await _first_run(LLAMA, tmp_path)
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


async def _scanned(engine) -> None:
    """Until the SSD tier has scanned its directory (the first entry indexed)."""
    with trio.fail_after(30):
        while engine.status()["prompt_cache"]["ssd"]["entries"] < 1:
            await trio.sleep(0.01)


async def test_a_fifo_in_the_directory_is_never_opened_and_blocks_nothing(tmp_path: Path, caplog) -> None:
    """A FIFO under an entry's name at start (and one swapped in for an indexed file later) is skipped
    with a warning and left alone; requests complete exactly and health stays ok (issue #21 point 5)."""
    cold, _ = await _first_run(LLAMA, tmp_path)
    (entry_file,) = tmp_path.glob("*.safetensors")
    planted = tmp_path / f"{'0' * 32}{SUFFIX}"
    os.mkfifo(planted)
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prompt_cache_dir=tmp_path) as engine:
        await _scanned(engine)
        assert engine.health() == (True, "ok")
        swapped = tmp_path / "swap.fifo"
        os.mkfifo(swapped)
        os.replace(swapped, entry_file)  # the indexed entry is now a FIFO: a reader that opened it would wait forever
        ids, finished = await _run(engine)
        stats = engine.status()["prompt_cache"]["ssd"]
        ok, _ = engine.health()
    assert ids == cold and finished.usage.cached_tokens == 0 and ok
    assert stats["reads"] == 0 and not stats["degraded"]
    # Left alone (the swapped one may since be replaced by a new entry written under its name).
    assert stat.S_ISFIFO(planted.lstat().st_mode)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("not regular files" in w for w in warnings) and any("not a regular file" in w for w in warnings)


async def test_a_hung_disk_turns_the_ssd_tier_off_and_requests_run_on_exactly(tmp_path: Path) -> None:
    """A read that blocks past --prompt-cache-io-timeout (stall-io: its worker thread waits, as on a hung
    disk) is abandoned: the request runs uncached with its exact tokens, health stays ok while it hangs,
    the tier is off with its reason in the status and the next requests use RAM only (issue #21 point 5)."""
    cold, _ = await _first_run(LLAMA, tmp_path)
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prompt_cache_dir=tmp_path,
                           prompt_cache_io_timeout_s=0.5) as engine:
        await _scanned(engine)
        engine.faults.arm("cache-persistence", "stall-io")
        health: list[bool] = []
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                while True:
                    health.append(engine.health()[0])
                    await trio.sleep(0.05)

            nursery.start_soon(watch)
            ids, finished = await _run(engine)
            nursery.cancel_scope.cancel()
        again, cached = await _run(engine)
        stats = engine.status()["prompt_cache"]["ssd"]
    assert ids == cold == again and finished.usage.cached_tokens == 0
    assert cached.usage.cached_tokens > 500  # the RAM tier still serves
    assert len(health) > 1 and all(health)  # the event loop ran, and health said ok, through the stall
    assert stats["degraded"] and stats["reads"] == 0 and stats["entries"] == 0
    assert "disk stalled: a read in" in stats["reason"] and str(tmp_path) in stats["reason"]


def _reshaped(entry: HostEntry, how: str) -> HostEntry:
    """`entry` with its arrays made unfit for the model that wrote it, one way."""
    arrays = dict(entry.arrays)
    meta = dict(entry.meta)
    if how == "head_dim":
        arrays = {k: a[..., : a.shape[-1] // 2] if a.ndim == 4 else a for k, a in arrays.items()}
    elif how == "dtype":
        arrays = {k: a.astype(np.float32 if a.itemsize == 2 else np.float16) if a.ndim == 4 else a
                  for k, a in arrays.items()}
    else:  # one layer fewer
        classes, states = json.loads(meta[CLASSES]), json.loads(meta[STATES])
        last = len(classes) - 1
        meta = {CLASSES: json.dumps(classes[:last]), STATES: json.dumps(states[:last])}
        arrays = {k: a for k, a in arrays.items() if not k.startswith(f"{last}.")}
    return HostEntry(entry.tokens, arrays, meta)


@pytest.mark.parametrize("how", ["head_dim", "dtype", "layers"])
async def test_an_entry_that_passes_its_checksum_but_does_not_fit_is_dropped(tmp_path: Path, how: str) -> None:
    """An SSD entry with a valid checksum but the wrong head_dim, dtype or layer count: two requests sharing
    its prefix both complete with the uncached tokens, the file is removed and counted (issue #21 point 6)."""
    cold, prompt = await _first_run(LLAMA, tmp_path)
    store, info = _keep_only_the_prompt_entry(tmp_path, prompt)
    path = info.path
    bad = _reshaped(store.read(info.key), how)
    store.remove(info.key)
    assert store.write(bad).path == path  # same tokens, same name; a checksum over the unfit arrays
    bad_bytes = path.read_bytes()
    async with open_engine(str(tiny_model(LLAMA)), batch=4, prompt_cache_dir=tmp_path) as engine:
        first, _ = await _run(engine)
        second, _ = await _run(engine)
        await engine.drain_persistence()
        stats = engine.status()["prompt_cache"]["ssd"]
    assert first == second == cold
    assert stats["restore_failures"] == 1 and stats["reads"] == 0
    assert not path.exists() or path.read_bytes() != bad_bytes  # removed (the server may have written a good one)
