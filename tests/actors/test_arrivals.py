"""Requests on their way to the lane (actors/arrivals.py): counted from the prepare until admission takes them."""

from __future__ import annotations

import pytest
import trio

from mlx_trio.actors.arrivals import ARRIVAL_EXPIRY_S, Arrivals


async def test_a_request_counts_from_its_prepare_until_admission_takes_it_or_it_expires(autojump_clock) -> None:
    arrivals = Arrivals()
    with arrivals.preparing():
        assert arrivals.expected() == 1
    arrivals.prepared("a")
    arrivals.prepared("b")
    assert arrivals.expected() == 2
    arrivals.reached("a")
    arrivals.reached("never prepared")  # a request submitted without `prepare_off_loop`
    assert arrivals.expected() == 1
    await trio.sleep(ARRIVAL_EXPIRY_S)
    assert arrivals.expected() == 0  # "b" was never submitted


async def test_a_failed_prepare_stops_counting() -> None:
    arrivals = Arrivals()
    with pytest.raises(ValueError), arrivals.preparing():
        raise ValueError("a 400")
    assert arrivals.expected() == 0
