"""`mlx-trio serve --tensor-parallel 2` as a subprocess: two local ring ranks on a free loopback port."""

from __future__ import annotations

import os
import re
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


@contextmanager
def two_rank_server(model: Path, *flags: str, env: dict[str, str] | None = None,
                    log: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Yields (base URL, the process); SIGTERM on exit (killed, with every rank, if it will not stop)."""
    argv = [sys.executable, "-m", "mlx_trio.cli", "serve", "--model", str(model), "--port", "0",
            "--tensor-parallel", "2", *flags]
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
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                for pid in _tree(process.pid):  # the launcher has a session of its own: kill by pid
                    os.kill(pid, signal.SIGKILL)
                process.wait()
        reader.join(10)


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it, parents first."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [pid, *(p for child in out.split() for p in _tree(int(child)))]
