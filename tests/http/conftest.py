"""Fixtures for the HTTP tests (helpers live in http_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.http.http_helpers import ServerThread, tiny_engine_config

from mlx_trio.http import ServerConfig
from mlx_trio.output_format import OutputFormat


@pytest.fixture(scope="module")
def live_server() -> Iterator[ServerThread]:
    """A tiny Llama behind the real HTTP stack on a random port, shared by a test module."""
    with ServerThread(tiny_engine_config(), ServerConfig(port=0)) as server:
        yield server


@pytest.fixture(autouse=True)
def _live_server_idle(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the shared `live_server`: its engine's pools are idle again (docs/design.md §7.3)."""
    yield
    if "live_server" in request.fixturenames:
        request.getfixturevalue("live_server").report_leaks()


@pytest.fixture(scope="session")
def tools_format() -> OutputFormat:
    """The output format mlx-lm reads from the QWEN3_TOOLS tiny model (Hermes `<tool_call>` JSON, `<think>`)."""
    from mlx_lm.tokenizer_utils import load  # noqa: PLC0415  (tests may import mlx-lm; the http package may not)

    from mlx_trio.engine.model.output_format import read_output_format  # noqa: PLC0415
    from mlx_trio.testing import QWEN3_TOOLS, tiny_model  # noqa: PLC0415

    return read_output_format(load(tiny_model(QWEN3_TOOLS)))
