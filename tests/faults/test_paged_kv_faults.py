"""--kv-layout paged under actor crashes: every stream resumes token-exact and no block stays referenced afterwards.

A crashed decoder's batch and a crashed prefill's rows give their blocks back (`DecodeBatch.close`,
`SoloRow.close`, on the lease thread); a leak would leave `kv_bytes` (blocks used x block bytes) above zero.
"""

from __future__ import annotations

import itertools

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.faults.test_kill_actors import _run_streams, _wait_healthy, solo  # noqa: F401  (the fixture)

BUDGET = 16 << 20


@pytest.mark.parametrize(("actor", "batch"), [("decode-step", 8), ("prefill", 4), ("gpu-lease", 8)])
async def test_kill_mid_generation_on_paged_kv_resumes_exact_and_frees_every_block(solo, actor, batch) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=batch, kv_layout="paged", kv_budget_bytes=BUDGET) as engine:
        streams = await _run_streams(engine, lambda: engine.faults.arm(actor, "raise"), after=1 if batch == 4 else 8)
        assert streams == solo
        assert engine.faults.fired, "the fault never fired"
        await _wait_healthy(engine)  # kv_bytes back to 0: every block released
        with trio.fail_after(5):
            while engine.status()["counters"]["kv_blocks"]["used"]:
                await trio.sleep(0.01)
        blocks = engine.status()["counters"]["kv_blocks"]
        assert blocks["used"] == blocks["shared"] == 0 and blocks["free"] + blocks["cached"] == blocks["total"]


@pytest.mark.parametrize("kind", ["raise", "fail-write"])
async def test_a_killed_or_failed_block_write_loses_only_that_run(solo, tmp_path, kind) -> None:
    """--kv-layout paged with --prompt-cache-dir: the cache-persistence actor dies (or a write fails) between copying a
    run of blocks off the device and writing it. Streams are untouched, no partial file is left, the actor goes
    on (restarted) writing, and a new engine on the directory serves from what was written, token-exact."""
    from mlx_trio.actors.block_persistence import BLOCKS_SUBDIRECTORY
    from tests.faults.test_kill_actors import _node, _wait_healthy as _healthy
    from tests.prompts import PROMPTS

    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET,
                           prompt_cache_dir=tmp_path) as engine:
        engine.faults.arm("cache-persistence", kind)
        streams = await _run_streams(engine, lambda: None)
        assert streams == solo
        await _healthy(engine)
        with trio.fail_after(20):
            while not engine.faults.fired:
                await trio.sleep(0.01)
        with trio.fail_after(20):  # the (restarted) actor goes on writing: new chains reach the disk
            for n in itertools.count(1):
                await engine.complete(" ".join(["the sea and the wind"] * 20 + [str(n)]), max_tokens=4)
                while engine.status()["counters"]["kv_blocks"]["used"]:
                    await trio.sleep(0.01)
                await engine.drain_persistence()
                if engine.status()["prompt_cache"]["ssd"]["writes"]:
                    break
        node = _node(engine.status()["tree"], "cache-persistence")
        ssd = engine.status()["prompt_cache"]["ssd"]
        assert node is not None and node["restarts"] == (1 if kind == "raise" else 0)
        assert kind == "raise" or ssd["errors"] == 1
    assert not list(tmp_path.rglob("*.tmp*")) and list((tmp_path / BLOCKS_SUBDIRECTORY).iterdir())
    async with open_engine(str(tiny_model(LLAMA)), batch=8, kv_layout="paged", kv_budget_bytes=BUDGET,
                           prompt_cache_dir=tmp_path) as engine:
        for prompt, tokens in zip(PROMPTS, solo):
            assert (await engine.complete(prompt, max_tokens=len(tokens))).token_ids == tokens
        assert engine.status()["prompt_cache"]["ssd"]["errors"] == 0
