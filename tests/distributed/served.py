"""`mlx-trio serve` on two local ring ranks as a subprocess, on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.served_output import tee_output

REPO = Path(__file__).resolve().parents[2]
_SERVING = re.compile(r"mlx-trio: serving .* at (http://127\.0\.0\.1:\d+)/v1")
_START_TIMEOUT_S = 240.0


LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch"


@contextmanager
def two_rank_server(model: Path, *flags: str, env: dict[str, str] | None = None, log: Path,
                    mlx_launch: bool = False,
                    split: str = "--tensor-parallel") -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Yields (base URL, the process): `serve --tensor-parallel 2` (mlx-trio's own launcher, which
    launches the ranks again when the group is lost), or with `mlx_launch` the same server under
    `mlx.launch -n 2 --backend ring` (no re-forming). SIGTERM on exit (killed, with every rank, if it
    will not stop; at once under mlx.launch, which passes no signal on to its ranks). `split`:
    --tensor-parallel or --pipeline-parallel."""
    serve = ["-m", "mlx_trio.cli", "serve", "--model", str(model), "--port", "0", *flags]
    argv = ([LAUNCH, "-n", "2", "--backend", "ring", "--python", sys.executable, *serve] if mlx_launch
            else [sys.executable, *serve, split, "2"])
    process = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    url, ready, reader = tee_output(process, log, _SERVING)
    try:
        if not ready.wait(_START_TIMEOUT_S) or not url:
            pytest.fail(f"two ranks did not come up:\n{log.read_text(encoding='utf-8')[-5000:]}")
        yield url[0], process
    finally:
        if process.poll() is None:
            if not mlx_launch:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(0 if mlx_launch else 60)
            except subprocess.TimeoutExpired:
                for pid in _tree(process.pid):  # the ranks may have sessions of their own: kill by pid
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                process.wait()
        reader.join(10)


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it, parents first."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [pid, *(p for child in out.split() for p in _tree(int(child)))]
