"""The restart decisions on their own, and the package's public surface."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from mlx_trio.supervision import ChildSpec, Strategy
from mlx_trio.supervision.restart import RestartIntensity, affected


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [(Strategy.ONE_FOR_ONE, ["c"]), (Strategy.ONE_FOR_ALL, list("abcde")), (Strategy.REST_FOR_ONE, list("cde"))],
    ids=["one_for_one", "one_for_all", "rest_for_one"],
)
def test_affected_children_per_strategy(strategy: Strategy, expected: list[str]) -> None:
    """Each strategy picks the OTP set of children, in start order."""
    assert affected(strategy, list("abcde"), "c") == expected


def test_intensity_counts_restarts_within_the_window_inclusively() -> None:
    """A restart exactly period_s old still counts, as in OTP's add_restart."""
    intensity = RestartIntensity(max_restarts=2, period_s=1.0)
    assert intensity.add(0.0) and intensity.add(0.5)
    assert not intensity.add(1.0)
    assert RestartIntensity(max_restarts=2, period_s=1.0).add(0.0)


def test_intensity_forgets_restarts_older_than_the_window() -> None:
    """Restarts older than period_s stop counting."""
    intensity = RestartIntensity(max_restarts=1, period_s=1.0)
    assert intensity.add(0.0)
    assert intensity.add(1.25)
    assert not intensity.add(1.5)


def test_zero_max_restarts_gives_up_on_the_first_restart() -> None:
    """max_restarts=0 allows no restart at all."""
    assert not RestartIntensity(max_restarts=0, period_s=5.0).add(0.0)


def test_child_spec_is_frozen_and_rejects_negative_shutdown() -> None:
    """ChildSpec is an immutable value and shutdown_s may not be negative."""

    async def start() -> None: ...

    spec = ChildSpec(id="a", start=start)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.id = "b"  # type: ignore[misc]
    with pytest.raises(ValueError, match="shutdown_s"):
        ChildSpec(id="a", start=start, shutdown_s=-1.0)


def test_supervision_never_imports_mlx() -> None:
    """Importing mlx_trio.supervision loads neither mlx nor mlx_lm."""
    code = (
        "import sys, mlx_trio.supervision\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
