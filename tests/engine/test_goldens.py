"""mlx-trio's engine reproduces mlx-lm token for token (goldens/tiny.json).

The goldens are written only by scripts/make_goldens.py, which runs mlx-lm's
own stream_generate on the same tiny models. Run through the whole actor
stack: open_engine → session → admission → prefill (SoloRow) → decode-step
(DecodeBatch) → GPU lease.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlx_trio import open_engine
from mlx_trio.testing.tiny_models import TinyModelSpec, tiny_model

from tests.goldens import GOLDENS, replay



def _spec(name: str) -> TinyModelSpec:
    return TinyModelSpec(**GOLDENS["models"][name])


def test_goldens_cover_every_architecture_and_sampling_mode() -> None:
    """The golden file has greedy and seeded cases for llama, qwen3 and the sliding-window model."""
    models = {c["model"] for c in GOLDENS["cases"]}
    assert models == {"llama", "qwen3", "llama_swa"}
    assert any(c["params"].get("seed") is not None for c in GOLDENS["cases"])
    assert all(len(c["tokens"]) > 0 for c in GOLDENS["cases"])


@pytest.mark.parametrize("batch", [1, 8], ids=["batch-1", "batch-8"])
@pytest.mark.parametrize("case", GOLDENS["cases"], ids=lambda c: f"{c['model']}-{c['name']}")
async def test_engine_matches_mlx_lm_token_for_token(case: dict[str, Any], batch: int) -> None:
    """Same prompt ids, same generated ids (EOS included in the count), same text, same finish reason.

    At `--batch 1` (the determinism pin: a row cap of 1) and `--batch 8`; a
    lone row adopts its solo caches and so runs mlx-lm's own graph.
    """
    path = tiny_model(_spec(case["model"]))
    async with open_engine(str(path), batch=batch, prefill_step_size=case.get("prefill_step_size", 2048)) as engine:
        await replay(engine, case)
