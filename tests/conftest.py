"""Suite-wide settings: a hypothesis profile fit for a loaded 2-core CI box, and the idle check of every test."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]  # tests/test_leak_check.py runs the idle check on a test of its own

# CI machines are small and shared: time limits per example would make tests
# flaky without making them stronger, so speed is measured by benchmarks instead.
settings.register_profile(
    "mlx-trio",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=100,
)
settings.load_profile("mlx-trio")


class _Records(logging.Handler):
    """Keeps every record it is given."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def leak_records() -> Iterator[list[logging.LogRecord]]:
    """Fail the test if an engine it ran in-process was closed idle yet holding a pool (docs/design.md §7).

    `open_engine` logs each leak on the leak log (`mlx_trio.api.leaks_log`) when it closes with every
    request ended (`Engine.report_leaks`). A test that leaks on purpose asks
    for this fixture and clears the list once it has checked it.
    """
    handler = _Records()
    logger = logging.getLogger("mlx_trio.leaks")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
    if handler.records:
        pytest.fail("resource pools not idle when the engine closed:\n"
                    + "\n".join(record.getMessage() for record in handler.records), pytrace=False)
