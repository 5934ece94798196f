"""Random crash sequences against a plain-Python model of OTP supervision."""

from __future__ import annotations

import attrs
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_trio.supervision import Restart, Strategy, Supervisor, SupervisorGaveUp
from tests.supervision.supervision_helpers import Worker, recording

CRASH_KINDS = ("raise", "return", "raise_then_fail_start")


@attrs.frozen
class Scenario:
    """Children's restart types, supervisor settings, and timed crashes to apply."""

    restarts: tuple[Restart, ...]
    strategy: Strategy
    max_restarts: int
    period_s: float
    # (seconds after the previous event, child index, crash kind); binary fractions
    # keep virtual times exact, so the model and the clock agree on window edges.
    events: tuple[tuple[float, int, str], ...]
    end_by_cancel: bool


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    restarts = tuple(draw(st.lists(st.sampled_from(list(Restart)), min_size=3, max_size=5)))
    event = st.tuples(
        st.sampled_from([0.25, 0.5, 1.0, 2.0]),
        st.integers(min_value=0, max_value=len(restarts) - 1),
        st.sampled_from(CRASH_KINDS),
    )
    return Scenario(
        restarts=restarts,
        strategy=draw(st.sampled_from(list(Strategy))),
        max_restarts=draw(st.integers(min_value=0, max_value=4)),
        period_s=draw(st.sampled_from([1.0, 2.0, 5.0])),
        events=tuple(draw(st.lists(event, max_size=12))),
        end_by_cancel=draw(st.booleans()),
    )


@attrs.define
class _ModelChild:
    name: str
    restart: Restart
    running: bool = True


def model(scenario: Scenario) -> list[str]:
    """Return the log OTP semantics predict for `scenario`, written without the supervisor's code."""
    children = [_ModelChild(f"c{i}", r) for i, r in enumerate(scenario.restarts)]
    log = [f"start {c.name}" for c in children]
    fail_next_start: set[str] = set()
    history: list[float] = []
    now = 0.0
    for delay, index, kind in scenario.events:
        now += delay
        name = f"c{index}"
        crashed = next((c for c in children if c.name == name and c.running), None)
        if crashed is None:
            continue  # removed or stopped: the test cannot crash it either
        crashed.running = False
        log.append(f"return {name}" if kind == "return" else f"crash {name}")
        if kind == "raise_then_fail_start":
            fail_next_start.add(name)
        if crashed.restart is Restart.TEMPORARY:
            children.remove(crashed)
            continue
        if crashed.restart is Restart.TRANSIENT and kind == "return":
            continue
        while True:
            history = [t for t in history if t >= now - scenario.period_s] + [now]
            if len(history) > scenario.max_restarts:
                log += [f"stop {c.name}" for c in reversed(children) if c.running]
                return [*log, "gave up"]
            position = children.index(crashed)
            group = {
                Strategy.ONE_FOR_ONE: [crashed],
                Strategy.ONE_FOR_ALL: list(children),
                Strategy.REST_FOR_ONE: children[position:],
            }[scenario.strategy]
            for c in reversed(group):
                if c.running:
                    log.append(f"stop {c.name}")
                    c.running = False
            failed = None
            for c in group:
                if c is not crashed and c.restart is Restart.TEMPORARY:
                    children.remove(c)
                elif failed is None:
                    if c.name in fail_next_start:
                        fail_next_start.discard(c.name)
                        log.append(f"start-failed {c.name}")
                        failed = c
                    else:
                        log.append(f"start {c.name}")
                        c.running = True
            if failed is None:
                break
            crashed = failed
    return log + [f"stop {c.name}" for c in reversed(children) if c.running]


async def observe(scenario: Scenario) -> list[str]:
    """Run `scenario` against a real Supervisor and return its log."""
    log: list[str] = []
    fail_next_start: set[str] = set()
    specs = [
        recording(f"c{i}", log, restart=restart, fail_next_start=fail_next_start)
        for i, restart in enumerate(scenario.restarts)
    ]
    sup = Supervisor("top", specs, strategy=scenario.strategy, max_restarts=scenario.max_restarts, period_s=scenario.period_s)
    gave_up = trio.Event()

    async def supervise(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await sup.run(task_status=task_status)
        except SupervisorGaveUp:
            log.append("gave up")
            gave_up.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(supervise)
        for delay, index, kind in scenario.events:
            await trio.sleep(delay)
            worker = sup.handle(f"c{index}")
            if gave_up.is_set():
                break
            if not isinstance(worker, Worker):
                continue
            if kind == "return":
                worker.finish()
            else:
                if kind == "raise_then_fail_start":
                    fail_next_start.add(f"c{index}")
                worker.crash()
        await trio.sleep(0.25)
        if scenario.end_by_cancel:
            nursery.cancel_scope.cancel()
        else:
            await sup.stop()
    return log


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_supervisor_matches_the_otp_model(scenario: Scenario) -> None:
    """Any sequence of crashes, returns and failed restarts gives exactly the log the OTP model predicts."""
    observed = trio.run(observe, scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    assert observed == model(scenario)
