"""The idle check: an engine closed with every request ended reports each pool still held (docs/design.md §7)."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.api import leaks_log
from mlx_trio.actors.messages import Generate
from mlx_trio.events import TextDelta
from mlx_trio.params import SamplingParams
from mlx_trio.testing.tiny_models import LLAMA, tiny_model


async def test_an_idle_engine_reports_nothing(leak_records) -> None:
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        done = await engine.complete("Once upon a time there was", max_tokens=4)
        assert done.usage.completion_tokens == 4
        with trio.fail_after(5):
            while engine.not_idle():  # the last leave is one decode step behind `Finished`
                await trio.sleep(0.01)
        assert await engine.report_leaks() == []
    assert leak_records == []


async def test_a_leaked_reservation_is_logged_at_close(leak_records) -> None:
    """A reservation no request holds (one `end_request` never released) is reported; this fixture
    would fail the test for it, so the test clears what it checked."""
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        await engine.complete("Once upon a time there was", max_tokens=2)
        send, _recv = trio.open_memory_channel(1)
        leaked = Generate("req-leaked", (1, 2, 3), SamplingParams(max_tokens=4), reply=send)
        engine.actors.lane.admission._reserve(leaked)  # a reservation whose release was forgotten
    messages = [record.getMessage() for record in leak_records]
    assert {record.name for record in leak_records} == {leaks_log.name}
    assert any("admission reserved bytes" in message for message in messages), messages
    assert any("admission rows in flight: 1" in message for message in messages), messages
    leak_records.clear()


async def test_a_request_its_caller_left_frees_every_pool(leak_records) -> None:
    """Leaving a stream early ends the request at once (the generator is closed, not left to garbage
    collection): every pool goes idle and the close finds nothing."""
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        async with aclosing(engine.generate("Once upon a time there was", max_tokens=200)) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    break
        with trio.fail_after(5):
            while engine.not_idle():
                await trio.sleep(0.01)
    assert leak_records == []


async def test_an_engine_closed_mid_stream_is_not_judged(leak_records) -> None:
    """A stream still open at close (a test that cancels) holds its row by design: nothing is logged."""
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        stream = engine.generate("Once upon a time there was", max_tokens=50)
        await stream.__anext__()
        assert await engine.report_leaks() == []
    assert leak_records == []
    await stream.aclose()


def test_the_fixture_fails_a_test_that_logged_a_leak(pytester: pytest.Pytester, leak_records) -> None:
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_leaky="""
        import logging

        def test_leaky():
            logging.getLogger("mlx_trio.leaks").error("engine closed ..., yet it holds admission reserved bytes: 8")
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:trio")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*resource pools not idle when the engine closed:*", "*admission reserved bytes: 8*"])
    leak_records.clear()  # the inner test logged on this process's logger too
