"""How busy the GPU was during a run: `nvidia-smi`'s utilisation, sampled while the run lasts.

A serving benchmark that reports tok/s alone cannot say whether the GPU or
the host was the limit; the fraction of time the GPU was busy can (issue
#20 found 20-36 % under HTTP load where the engine alone kept it busy).
`nvidia-smi --query-gpu=utilization.gpu -lms N` prints one line per GPU
every N ms; the sampler reads them until cancelled. Where there is no
`nvidia-smi` (a Mac, this CPU box), nothing is sampled and the column stays
blank.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from collections.abc import Sequence

import trio

SAMPLE_MS = 200


def available() -> bool:
    return shutil.which("nvidia-smi") is not None


async def sample(into: list[float], *, interval_ms: int = SAMPLE_MS, command: Sequence[str] | None = None) -> None:
    """Append the busy percentage of every GPU line `nvidia-smi` prints to `into`, until cancelled.

    `command` replaces the `nvidia-smi` invocation (tests); it must print one
    number per line. A command that fails or prints something else adds nothing.
    """
    argv = list(command) if command is not None else [
        "nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", f"-lms={interval_ms}"]
    try:
        process = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    except OSError:
        return
    assert process.stdout is not None
    buffer = b""
    try:
        async for data in process.stdout:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                try:
                    into.append(float(line.strip()))
                except ValueError:
                    continue
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


def mean(samples: Sequence[float]) -> float | None:
    """The mean busy percentage, or None when nothing was sampled."""
    return statistics.fmean(samples) if samples else None
