"""--kv-layout paged under actor crashes: every stream resumes token-exact and no block stays referenced afterwards.

A crashed decoder's batch and a crashed prefill's rows give their blocks back (`DecodeBatch.close`,
`SoloRow.close`, on the lease thread); a leak would leave `kv_bytes` (blocks used x block bytes) above zero.
"""

from __future__ import annotations

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
