"""`mlx-trio serve` as a subprocess on a free loopback port, serving the scripted tiny model.

A real process, not the in-thread server of tests/http: the clients are real
processes too, and this is the command a user runs before pointing them at it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from tests.clients.clients import REPO
from tests.clients.scripted_model import scripted_model
from tests.served_output import tee_output
from tests.http.conftest import tools_format  # noqa: F401  (the fixture, for the scripted-engine tool turns)

REPLY = "The tiny model says pong."
# The line `mlx-trio serve` prints once the model is loaded and the port is open.
_SERVING = re.compile(r"^mlx-trio: serving .* at (http://127\.0\.0\.1:\d+)/v1")
_START_TIMEOUT_S = 300.0


@attrs.frozen
class Served:
    """A running server: its base URL (no /v1) and the file its output goes to."""

    url: str
    log: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`mlx-trio serve --port 0` on the model that always answers REPLY; stopped (SIGTERM) after the module."""
    root = tmp_path_factory.mktemp("served")
    model = scripted_model(REPLY, root)
    log = root / "server.log"
    argv = [sys.executable, "-m", "mlx_trio.cli", "serve", "--model", str(model), "--port", "0",
            "--cache-dir", str(root / "cache"), "--log-level", "INFO"]
    # cwd = the repository, so a worktree's own code is the one imported.
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, text=True)
    url, ready, reader = tee_output(process, log, _SERVING)
    try:
        if not ready.wait(_START_TIMEOUT_S) or not url:
            pytest.fail(f"mlx-trio serve did not come up; its output:\n{log.read_text(encoding='utf-8')}")
        yield Served(url=url[0], log=log)
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(10)
