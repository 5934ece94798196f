"""Two ranks on the CPU ring backend (`mlx.launch -n 2 --backend ring`): the one-process tokens, sharded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_trio import open_engine
from mlx_trio.testing.tiny_models import LLAMA, TinyModelSpec, tiny_model
from tests.distributed.two_ranks import prompt

REPO = Path(__file__).resolve().parents[2]
LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch"


def launch_two_ranks(module: str, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """`mlx.launch -n 2 --backend ring` of ``python -m module args`` from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--python", sys.executable, "-m", module, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


def _report(done: subprocess.CompletedProcess[str]) -> dict:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.slow  # two processes that each load, shard and warm up: ~30 s on a 2-core machine
async def test_four_concurrent_greedy_requests_on_two_ranks_give_the_one_process_tokens() -> None:
    """Tensor parallel over 2 ranks, --batch 4: each request's tokens are its one-process solo tokens, in a
    first round and in a second one from the prompt cache, and rank 0 holds only its shard of the weights."""
    path = tiny_model(LLAMA)
    async with open_engine(str(path), batch=1) as engine:
        expected = [list((await engine.complete(prompt(i), max_tokens=16)).token_ids) for i in range(4)]
        whole = engine.actors.lane.model.weights_bytes
    report = _report(launch_two_ranks("tests.distributed.two_ranks", str(path), "4", "16", "{}", "0", "1", "2", "3"))
    assert report["world"] == {"size": 2, "backend": "ring"}
    assert report["rounds"] == [expected, expected]
    assert report["cache_hits"] > 0  # the second round started from the first's entries (keyed caches)
    assert report["weights_bytes"] < whole  # the attention and MLP projections are split in two


@pytest.mark.slow
async def test_prompt_lookup_on_two_ranks_gives_the_one_process_tokens() -> None:
    """Speculation by prompt lookup runs in lockstep (its proposer is sent to the followers by pickle):
    the tokens of plain one-process decoding, with proposals verified."""
    path = tiny_model(LLAMA)
    async with open_engine(str(path), batch=1) as engine:
        expected = [list((await engine.complete(prompt(i), max_tokens=24)).token_ids) for i in range(4)]
    report = _report(launch_two_ranks("tests.distributed.two_ranks", str(path), "4", "24", '{"prompt_lookup": true}',
                                      "0", "1", "2", "3"))
    assert report["rounds"] == [expected, expected]
    assert report["speculative_proposed"] > 0  # rows were verified against proposals, in lockstep


@pytest.mark.slow
async def test_pipeline_parallel_on_two_ranks_gives_the_one_process_tokens() -> None:
    """A qwen2 model (mlx-lm gives it pipeline()) split by layers over 2 ranks, --batch 4: each request's
    one-process tokens, in both rounds, and rank 0 holds only its run of layers."""
    path = tiny_model(TinyModelSpec("qwen2"))
    async with open_engine(str(path), batch=1) as engine:
        expected = [list((await engine.complete(prompt(i), max_tokens=16)).token_ids) for i in range(4)]
        whole = engine.actors.lane.model.weights_bytes
    report = _report(launch_two_ranks("tests.distributed.two_ranks", str(path), "4", "16", '{"pipeline": true}',
                                      "0", "1", "2", "3"))
    assert report["rounds"] == [expected, expected]
    assert report["weights_bytes"] < whole  # half the layers (embedding, norm and head on every rank)
