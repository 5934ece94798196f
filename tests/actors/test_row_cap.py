"""`--batch auto` (the default): the row cap from the KV budget and the model; `--batch N` keeps its meaning."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from mlx_trio import open_engine
from mlx_trio.actors.row_cap import AUTO_CEILING, AUTO_CONTEXT_TOKENS, AUTO_FLOOR, auto_row_cap, row_bound
from mlx_trio.config import EngineConfig, parse_batch
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.prompts import PROMPTS

LLAMA_1B_BYTES_PER_TOKEN = 2 * 16 * 8 * 64 * 2  # K and V, 16 layers, 8 KV heads of 64, bf16: 32 KiB


def _llama_1b(tokens: int) -> int:
    return tokens * LLAMA_1B_BYTES_PER_TOKEN


@pytest.mark.parametrize(("budget_gib", "rows"), [(100, 64), (4, 16), (2.5, 10), (1, 8), (0.01, 8)])
def test_auto_is_the_rows_of_8k_tokens_the_budget_fits_within_8_and_64(budget_gib: float, rows: int) -> None:
    """Llama-1B's row of 8k tokens is 256 MiB: 4 GiB fits 16 rows, 2.5 GiB 10; 100 GiB is capped at 64, 1 GiB
    is raised to the old default of 8."""
    assert auto_row_cap(int(budget_gib * 2**30), _llama_1b) == rows


@given(st.integers(0, 2**44), st.integers(1, 2**20))
def test_auto_is_the_clamped_quotient(budget: int, bytes_per_token: int) -> None:
    rows = auto_row_cap(budget, lambda n: n * bytes_per_token)
    assert rows == min(max(budget // (AUTO_CONTEXT_TOKENS * bytes_per_token), AUTO_FLOOR), AUTO_CEILING)


def test_parse_batch() -> None:
    """"auto" (any case) and None are auto; a positive integer is kept; anything else names the flag."""
    assert parse_batch("auto") is None and parse_batch("AUTO") is None and parse_batch(None) is None
    assert parse_batch("12") == 12 and parse_batch(1) == 1
    for bad in ("0", "-3", "eight", "1.5"):
        with pytest.raises(ValueError, match="--batch"):
            parse_batch(bad)
    assert EngineConfig().batch is None  # auto is the default
    assert row_bound(None) == AUTO_CEILING and row_bound(3) == 3


async def test_auto_admits_the_rows_the_budget_allows_not_8() -> None:
    """A budget that fits 10 rows of 8k tokens: auto's cap is 10 (status says so, and that it was auto), and
    12 concurrent requests run 10 rows at once, more than the old fixed 8."""
    from mlx_lm import load  # noqa: PLC0415  (tests may use mlx-lm)

    from mlx_trio.engine.kv.layout import measure_layout  # noqa: PLC0415

    path = str(tiny_model(LLAMA))
    per_row = measure_layout(load(path)[0]).row_bytes(AUTO_CONTEXT_TOKENS)
    async with open_engine(path, kv_budget_bytes=10 * per_row + per_row // 2) as engine:
        lane = engine.actors.lane
        assert lane.auto_rows == 10 and lane.row_cap == 10
        counters = engine.status()["counters"]
        assert counters["configured"] == 10 and counters["auto"] is True and counters["mode"] == "batch"
        most = 0

        async def one(prompt: str) -> None:
            # Long enough that the first rows still decode when the last are submitted, even on a loaded box.
            await engine.complete(prompt, max_tokens=160)

        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(one, PROMPTS[i % len(PROMPTS)])
            while lane.admission.statistics().submitted < 12 or lane.in_flight():
                most = max(most, lane.admission.statistics().in_flight_rows)  # rows admitted: what the cap bounds
                await trio.sleep(0)
        assert most == 10
        with trio.fail_after(10):  # the last row's reservation is released just after its reply ends
            while lane.admission.statistics().in_flight_rows:
                await trio.sleep(0.01)
        assert lane.admission.statistics().in_flight_rows == 0 and lane.held_kv_bytes() == lane.caching.nbytes


async def test_batch_n_keeps_its_meaning() -> None:
    """--batch 3 caps at 3 whatever the budget allows, and status says it was not auto."""
    async with open_engine(str(tiny_model(LLAMA)), batch=3) as engine:
        lane = engine.actors.lane
        assert lane.auto_rows is None and lane.row_cap == 3 and lane.admission.statistics().max_rows == 3
        counters = engine.status()["counters"]
        assert counters["configured"] == 3 and counters["auto"] is False
