"""--kv-layout paged with --prompt-cache-dir: the SSD tier stores the pool's keyed blocks as runs and a new engine on the
same directory reads them back into free blocks, computing only the prompt's tail with the same greedy tokens."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_trio import open_engine
from mlx_trio.actors.block_persistence import BLOCKS_SUBDIRECTORY
from mlx_trio.engine.prompt_cache.ssd_files import SUFFIX
from mlx_trio.events import Finished
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.prompts import run_to_end

BUDGET = 64 << 20  # 8,192 blocks of 16 tokens of the tiny llama (admission also counts a prefill transient)
BLOCK = 16
SYSTEM = "You are a careful agent. Read the sea story and answer in plain words. " * 10
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the ship."}]
OTHER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count the waves, one by one."}]
MAX_TOKENS = 8


@cache
def _serial(prompt: tuple[int, ...], adapter: str | None = None) -> tuple[int, ...]:
    """mlx-lm's own greedy tokens for `prompt` (the oracle), with `load(adapter_path=)` of the tiny adapter
    `adapter` if one is named."""
    from tests.engine.adapters.test_row_lora import _adapter_dir

    path = str(_adapter_dir("llama", adapter)) if adapter else None
    model, tokenizer = load(str(tiny_model(LLAMA)), adapter_path=path)
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return tuple(out)


def _engine(directory: Path | None, **options: Any):
    return open_engine(str(tiny_model(LLAMA)), batch=4, kv_layout="paged", kv_budget_bytes=BUDGET,
                       prompt_cache_dir=directory, **options)


async def _run(engine, chat=CHAT) -> tuple[tuple[int, ...], Finished]:
    return await run_to_end(engine, chat, MAX_TOKENS)


async def _settle(engine) -> None:
    """Every row gone (its blocks offered at its leave) and every offered run written."""
    with trio.fail_after(10):
        while engine.status()["counters"]["kv_blocks"]["used"]:
            await trio.sleep(0.01)
    await engine.drain_persistence()


def _ssd(engine) -> dict[str, Any]:
    return engine.status()["prompt_cache"]["ssd"]


def _files(directory: Path) -> list[Path]:
    return sorted((directory / BLOCKS_SUBDIRECTORY).glob(f"*{SUFFIX}"))


async def _first_run(directory: Path, writes: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    async with _engine(directory) as engine:
        prompt = tuple(engine.prepare(CHAT).prompt_ids)
        ids, finished = await _run(engine)
        assert finished.usage.cached_tokens == 0
        await _settle(engine)
        ssd = _ssd(engine)
    assert ssd["enabled"] and ssd["writes"] == writes and not ssd["degraded"], ssd
    return ids, prompt


async def test_a_new_engine_on_the_directory_computes_only_the_tail_with_the_same_tokens(tmp_path: Path) -> None:
    cold, prompt = await _first_run(tmp_path)
    assert len(_files(tmp_path)) == 1
    async with _engine(tmp_path) as engine:
        ids, finished = await _run(engine)
        await _settle(engine)
        ssd = _ssd(engine)
    assert finished.usage.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK > 200
    assert ssd["reads"] == 1 and ssd["restore_failures"] == 0
    assert ssd["writes"] <= 1 and _tiles_one_chain(_runs(tmp_path))  # at most a grown last block is new
    async with _engine(None) as engine:  # no SSD tier: the reference run
        plain, _ = await _run(engine)
    assert ids == cold == plain == _serial(prompt)


async def test_runs_share_the_stored_prefix_and_a_sibling_restores_it(tmp_path: Path) -> None:
    """A second prompt with the same system prompt stores only its own blocks (a run after the shared ones); a new
    engine serving it reads both runs."""
    await _first_run(tmp_path)
    async with _engine(tmp_path) as engine:
        other_prompt = tuple(engine.prepare(OTHER).prompt_ids)
        ids, finished = await _run(engine, OTHER)
        await _settle(engine)
    assert ids == _serial(other_prompt)
    async with _engine(tmp_path) as engine:
        again, finished = await _run(engine, OTHER)
        await _settle(engine)
        ssd = _ssd(engine)
    assert again == ids and finished.usage.cached_tokens == (len(other_prompt) - 1) // BLOCK * BLOCK
    assert ssd["reads"] == 1


@pytest.mark.parametrize("damage", ["truncate", "flip"])
async def test_a_damaged_block_file_costs_a_prefill_not_a_request(tmp_path: Path, damage: str) -> None:
    cold, prompt = await _first_run(tmp_path)
    (path,) = _files(tmp_path)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # same length, a wrong checksum: the scan keeps it, the read removes it
        path.write_bytes(data[:-100] + bytes(b ^ 0xFF for b in data[-100:]))
    async with _engine(tmp_path) as engine:
        ids, finished = await _run(engine)
        await _settle(engine)
    assert ids == cold and finished.usage.cached_tokens == 0
    assert not path.exists() or path.read_bytes() != data[: len(data) // 2]  # removed, or rewritten whole


async def test_the_byte_cap_evicts_the_oldest_files(tmp_path: Path) -> None:
    """Three prompts with nothing in common, under a cap that holds two runs: the oldest file goes."""
    # Raw token prompts of one length, each its own chain from the first token (a chat template's shared
    # opening would make the later prompts' runs continue the first one's).
    chats = [[first] + [100 + first] * 255 for first in (11, 12, 13)]
    async with _engine(tmp_path) as engine:
        await _run(engine, chats[0])
        await _settle(engine)
        size = _files(tmp_path)[0].stat().st_size
    cap = int(size * 2.5)
    async with _engine(tmp_path, prompt_cache_ssd_bytes=cap) as engine:
        for chat in chats[1:]:
            await _run(engine, chat)
            await _settle(engine)
        ssd = _ssd(engine)
    files = _files(tmp_path)
    assert len(files) == 2 and ssd["bytes"] <= cap
    async with _engine(tmp_path, prompt_cache_ssd_bytes=cap) as engine:
        _, first = await _run(engine, chats[0])  # its file was the oldest: evicted
        _, last = await _run(engine, chats[2])
    assert first.usage.cached_tokens == 0 and last.usage.cached_tokens > 150


async def test_a_crash_mid_write_loses_only_that_entry(tmp_path: Path) -> None:
    """The writer crashes between copying a run off the device and writing it: no partial file, the supervisor
    restarts it, and the next run is written; the request itself is unharmed."""
    async with _engine(tmp_path) as engine:
        prompt = tuple(engine.prepare(CHAT).prompt_ids)
        engine.faults.arm("cache-persistence", "raise")
        ids, _ = await _run(engine)
        await _settle(engine)
        assert engine.faults.fired
        assert _files(tmp_path) == [] and not list((tmp_path / BLOCKS_SUBDIRECTORY).glob(".*"))
        with trio.fail_after(10):  # restarted: the next request's blocks are written
            while True:
                await _run(engine, OTHER)
                await _settle(engine)
                if _files(tmp_path):
                    break
    assert ids == _serial(prompt)



async def test_a_long_chain_is_written_as_several_runs_and_read_back_whole(tmp_path: Path, monkeypatch) -> None:
    """Runs of at most RUN_BYTES a file (here 3 blocks): the chain is several files, a restore reads them all."""
    from mlx_trio.actors import block_persistence

    monkeypatch.setattr(block_persistence, "RUN_BYTES", 3 * 16 * 512)  # 3 blocks of the tiny llama
    cold, prompt = await _first_run(tmp_path, writes=-(-(len_chain := 23) // 3))
    assert len(_files(tmp_path)) == -(-len_chain // 3)
    async with _engine(tmp_path) as engine:
        ids, finished = await _run(engine)
        await _settle(engine)
        ssd = _ssd(engine)
    assert ids == cold and finished.usage.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    # A batch may step a finished row once more before it leaves, so the chain may have grown by a block: only
    # that block is new on disk.
    assert ssd["reads"] == 1 and ssd["writes"] <= 1 and _tiles_one_chain(_runs(tmp_path)), _runs(tmp_path)


async def test_a_failed_write_loses_that_run_and_writes_none_after_it(tmp_path: Path, monkeypatch) -> None:
    """fail-write on a chain's first run (of eight): nothing of the chain is written (a later run would be
    unreachable without it); the request is unharmed and the next chain is written."""
    from mlx_trio.actors import block_persistence

    monkeypatch.setattr(block_persistence, "RUN_BYTES", 3 * 16 * 512)
    async with _engine(tmp_path) as engine:
        prompt = tuple(engine.prepare(CHAT).prompt_ids)
        engine.faults.arm("cache-persistence", "fail-write")
        ids, _ = await _run(engine)
        await _settle(engine)
        ssd = _ssd(engine)
        assert engine.faults.fired
        assert ssd["writes"] == 0 and ssd["errors"] == 1 and _files(tmp_path) == []
        await _run(engine, OTHER)  # the actor goes on writing
        await _settle(engine)
        assert _ssd(engine)["writes"] > 0 and not _ssd(engine)["degraded"]
    assert ids == _serial(prompt)



def _runs(directory: Path) -> list[tuple[int, int]]:
    """The stored runs' (start, end) token positions, in order."""
    import base64

    import numpy as np
    from safetensors import safe_open

    out = []
    for path in _files(directory):
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata()
        out.append((int(meta.get("start", 0)), len(np.frombuffer(base64.b64decode(meta["tokens"]), "<i4"))))
    return sorted(out)


def _tiles_one_chain(runs: list[tuple[int, int]]) -> bool:
    """Each run starts where the one before ended: no block stored twice, none missing."""
    return bool(runs) and runs[0][0] == 0 and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))


async def test_requests_arriving_together_on_a_new_engine_all_take_the_stored_prefix(tmp_path: Path) -> None:
    """Four chats behind the stored system prompt sent at once to a new engine: the head's restore loads the
    prefix once, every admission pins and credits it, each chat equals mlx-lm's tokens, and the pool is idle."""
    await _first_run(tmp_path)
    tasks = ["Tell me about the ship.", "Count the waves, one by one.", "Name the robot.", "Why is the sky blue?"]
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}] for task in tasks]
    got: dict[int, tuple[tuple[int, ...], Finished]] = {}
    async with _engine(tmp_path) as engine:
        prompts = [tuple(engine.prepare(chat).prompt_ids) for chat in chats]

        async def one(i: int) -> None:
            got[i] = await _run(engine, chats[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(chats)):
                nursery.start_soon(one, i)
        await _settle(engine)
        ssd = _ssd(engine)
    shared = min(_agreed(prompts[0], p) for p in prompts[1:]) // BLOCK * BLOCK
    assert ssd["reads"] >= 1 and shared > 200
    for i, prompt in enumerate(prompts):
        ids, finished = got[i]
        assert ids == _serial(prompt) and finished.usage.cached_tokens >= shared


def _agreed(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def test_a_prefix_restored_from_disk_is_credited_as_a_cached_one(tmp_path: Path) -> None:
    """test_admission_prefix_credit's budget (8 siblings fit together only if their 10-block prefix is credited
    once), on a new engine whose prefix comes from the SSD tier: all 8 are admitted together, token-exact."""
    from tests.actors.test_admission_prefix_credit import BUDGET as CREDIT_BUDGET
    from tests.actors.test_admission_prefix_credit import MAX_TOKENS as CREDIT_TOKENS
    from tests.actors.test_admission_prefix_credit import SIBLINGS, _peak_in_flight

    options = dict(batch=8, kv_layout="paged", kv_budget_bytes=CREDIT_BUDGET, prompt_cache_dir=tmp_path)
    async with open_engine(str(tiny_model(LLAMA)), **options) as engine:
        alone = [(await engine.complete(p, max_tokens=CREDIT_TOKENS, temperature=0)).token_ids for p in SIBLINGS]
        await _settle(engine)
    async with open_engine(str(tiny_model(LLAMA)), **options) as engine:
        peak, tokens = await _peak_in_flight(engine, SIBLINGS)
        await _settle(engine)
        ssd = _ssd(engine)
        assert engine.actors.lane.admission.statistics().reserved_bytes == 0 and not engine.actors.lane.pins
    assert ssd["reads"] >= 1
    # Without the credit at most 5 fit together; with it all 8 (7 when the first one finished before the last was
    # admitted: the restore's read delays the head, and 2 shared CPUs make the steps' timing loose).
    assert peak >= len(SIBLINGS) - 1, f"only {peak} siblings were admitted together"
    assert tokens == alone


# -- adapter rows: their runs are in their revision's namespace, restored only for that revision -----------------


def _served(**names: str) -> dict[str, str]:
    """`lora_modules` serving each name the tiny adapter given (`qv="mlp"`: the mlp adapter's files as "qv")."""
    from tests.engine.adapters.test_row_lora import _adapter_dir

    return {name: str(_adapter_dir("llama", files)) for name, files in names.items()}


async def _run_as(engine, model: str | None, chat=CHAT) -> tuple[tuple[int, ...], Finished]:
    """`run_to_end` for the served model `model` (an adapter's name; None: the base model)."""
    from mlx_trio.events import TextDelta

    ids: list[int] = []
    async for event in engine.generate(chat, model=model, max_tokens=MAX_TOKENS):
        if isinstance(event, TextDelta):
            ids.extend(event.token_ids)
        elif isinstance(event, Finished):
            return tuple(ids), event
    raise AssertionError("no Finished event")


async def _settle_idle(engine) -> None:
    """`_settle`, then every reservation and pin of admission gone: the pools are back to idle."""
    await _settle(engine)
    admission = engine.actors.lane.admission
    assert admission.statistics().reserved_bytes == 0 and not engine.actors.lane.pins
    assert engine.status()["counters"]["kv_blocks"]["used"] == 0


async def test_an_adapter_rows_prefix_is_stored_and_a_new_engine_serving_its_files_computes_only_the_tail(
        tmp_path: Path) -> None:
    """qv's row leaves its blocks on disk; a new engine serving the same files under the same name restores them and
    computes only the tail, with mlx-lm's adapter tokens."""
    async with _engine(tmp_path, lora_modules=_served(qv="qv")) as engine:
        prompt = tuple(engine.prepare(CHAT).prompt_ids)
        cold, finished = await _run_as(engine, "qv")
        assert finished.usage.cached_tokens == 0
        await _settle_idle(engine)
        assert _ssd(engine)["writes"] == 1 and len(_files(tmp_path)) == 1
    async with _engine(tmp_path, lora_modules=_served(qv="qv")) as engine:
        ids, finished = await _run_as(engine, "qv")
        await _settle_idle(engine)
        ssd = _ssd(engine)
    assert finished.usage.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK > 200
    assert ssd["reads"] == 1 and ssd["restore_failures"] == 0
    async with _engine(None, lora_modules=_served(qv="qv")) as engine:  # no SSD tier: the reference run
        plain, _ = await _run_as(engine, "qv")
    assert ids == cold == plain == _serial(prompt, "qv") != _serial(prompt)


async def test_the_base_model_and_another_revision_under_the_same_name_compute_everything(tmp_path: Path) -> None:
    """An adapter's stored prefix never serves the base model's row of the same prompt, nor "qv" once it names other
    files (a new revision: the old one's runs are never read), and nothing is removed as a bad file.

    Nor another name serving the same files: the pool keys an adapter row's blocks under the name and the files'
    revision (`namespace.kv_revision`), so two names never share blocks, in RAM or on disk."""
    async with _engine(tmp_path, lora_modules=_served(qv="qv")) as engine:
        prompt = tuple(engine.prepare(CHAT).prompt_ids)
        await _run_as(engine, "qv")
        await _settle_idle(engine)
    async with _engine(tmp_path, lora_modules=_served(qv="mlp", alias="qv")) as engine:
        got = {name: await _run_as(engine, name) for name in (None, "qv", "alias")}
        await _settle_idle(engine)
        ssd = _ssd(engine)
    assert [finished.usage.cached_tokens for _, finished in got.values()] == [0, 0, 0]
    assert ssd["reads"] == 0 and ssd["restore_failures"] == 0
    assert got[None][0] == _serial(prompt) and got["qv"][0] == _serial(prompt, "mlp")
    assert got["alias"][0] == _serial(prompt, "qv")
    async with _engine(tmp_path, lora_modules=_served(qv="qv")) as engine:  # qv's own run is still there, intact
        _, finished = await _run_as(engine, "qv")
        await _settle_idle(engine)
    assert finished.usage.cached_tokens > 200


async def test_a_base_run_and_an_adapter_run_of_the_same_tokens_each_restore_to_their_own_rows(tmp_path: Path) -> None:
    """Both on disk as two files; a new engine's base row and qv row each find their own prefix, token-exact."""
    async with _engine(tmp_path, lora_modules=_served(qv="qv")) as engine:
        prompt = tuple(engine.prepare(CHAT).prompt_ids)
        await _run_as(engine, None)
        await _run_as(engine, "qv")
        await _settle_idle(engine)
        assert _ssd(engine)["writes"] == 2 and len(_files(tmp_path)) == 2
    tail = (len(prompt) - 1) // BLOCK * BLOCK
    for first in (None, "qv"):  # whichever comes first, each reads only its own
        async with _engine(tmp_path, lora_modules=_served(qv="qv")) as engine:
            got = {}
            for name in (first, "qv" if first is None else None):
                got[name] = await _run_as(engine, name)
            await _settle_idle(engine)
            ssd = _ssd(engine)
        assert ssd["reads"] == 2 and ssd["restore_failures"] == 0
        for name, (ids, finished) in got.items():
            assert finished.usage.cached_tokens == tail and ids == _serial(prompt, name), name


async def test_an_adapter_reloaded_with_other_files_at_run_time_finds_nothing_of_the_old(tmp_path: Path) -> None:
    """qv's prefix is on disk (and cached in RAM); qv unloaded, then loaded from other files: its rows compute
    everything, with the new files' tokens; loaded back from the first files, they find the old prefix again."""
    from tests.engine.adapters.test_row_lora import _adapter_dir

    async with _engine(tmp_path, enable_lora_admin=True) as engine:
        prompt = tuple(engine.prepare(CHAT).prompt_ids)
        await engine.load_adapter("qv", str(_adapter_dir("llama", "qv")))
        first, _ = await _run_as(engine, "qv")
        await _settle_idle(engine)
        await engine.unload_adapter("qv")
        await engine.load_adapter("qv", str(_adapter_dir("llama", "mlp")))
        other, other_finished = await _run_as(engine, "qv")
        await _settle_idle(engine)
        await engine.unload_adapter("qv")
        await engine.load_adapter("qv", str(_adapter_dir("llama", "qv")))
        again, again_finished = await _run_as(engine, "qv")
        await _settle_idle(engine)
        assert _ssd(engine)["restore_failures"] == 0
    assert other_finished.usage.cached_tokens == 0 and other == _serial(prompt, "mlp")
    assert again_finished.usage.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert first == again == _serial(prompt, "qv")
