"""bench/gpu_busy.py: the GPU's busy percentage sampled during a run, and its column in the table."""

from __future__ import annotations

import sys

import trio

from mlx_trio.bench import gpu_busy
from mlx_trio.bench.metrics import summarize
from mlx_trio.bench.report import markdown_table
from tests.bench.test_bench_runner import _echo_server, _one

FAKE_SMI = [sys.executable, "-c", "import sys, time; print('10'); print('n/a'); print('30', flush=True); time.sleep(60)"]


async def test_the_sampler_reads_one_number_per_line_until_cancelled() -> None:
    samples: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: gpu_busy.sample(samples, command=FAKE_SMI))
        with trio.fail_after(30):
            while len(samples) < 2:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert samples == [10.0, 30.0] and gpu_busy.mean(samples) == 20.0


async def test_a_missing_command_samples_nothing() -> None:
    samples: list[float] = []
    await gpu_busy.sample(samples, command=["/nonexistent/nvidia-smi"])
    assert samples == [] and gpu_busy.mean(samples) is None


async def test_the_table_shows_gpu_busy_only_when_it_was_sampled() -> None:
    result = await _one(_echo_server([]))
    sampled = summarize("ours", 8, [[result]], gpu_busy=[40.0, 60.0])
    assert sampled.gpu_busy_percent == 50.0
    table = markdown_table([sampled])
    assert "GPU busy %" in table.splitlines()[0] and table.splitlines()[2].endswith("| 50 |")
    assert "GPU busy" not in markdown_table([summarize("ours", 8, [[result]])])
