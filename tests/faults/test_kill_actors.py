"""Kill any actor mid-generation: it restarts and every stream resumes token-exact."""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any

import pytest
import trio

from mlx_trio import open_engine
from mlx_trio.errors import EngineDown, MlxTrioError
from mlx_trio.events import TextDelta
from mlx_trio.params import Constraint
from tests.prompts import PROMPTS, solo_tokens
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def solo() -> list[tuple[int, ...]]:
    """Each prompt's undisturbed greedy tokens at --batch 1 (alone: no other request shares a step)."""
    return solo_tokens(MAX_TOKENS)


def _node(tree: dict[str, Any], node_id: str) -> dict[str, Any] | None:
    if tree.get("id") == node_id:
        return tree
    for child in tree.get("children", []):
        found = _node(child, node_id)
        if found is not None:
            return found
    return None


async def _run_streams(engine, arm, *, after: int = len(PROMPTS)) -> list[tuple[int, ...]]:
    """Start 8 streams; once `after` of them have text, `arm()` the fault; collect each stream's token ids."""
    got: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    started = trio.Semaphore(0)

    async def one(i: int) -> None:
        first = True
        async for event in engine.generate(PROMPTS[i], max_tokens=MAX_TOKENS):
            if isinstance(event, TextDelta):
                got[i].extend(event.token_ids)
                if first:
                    first = False
                    started.release()

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
        for _ in range(after):
            await started.acquire()
        arm()
    return [tuple(got[i]) for i in range(len(PROMPTS))]


async def _wait_healthy(engine) -> None:
    with trio.fail_after(20):
        while not engine.health()[0] or engine.status()["counters"]["kv_bytes"]:
            await trio.sleep(0.01)


@pytest.mark.parametrize(
    ("actor", "kind", "batch"),
    [
        ("decode-step", "raise", 8),
        ("admission", "raise", 4),  # 4 of the 8 still queued when it dies
        ("prefill", "raise", 4),
        ("gpu-lease", "raise", 8),
        ("session", "raise", 8),
        ("decode-step", "raise", 1),
        ("gpu-lease", "hang", 8),
    ],
    ids=["decode-step", "admission", "prefill", "lease-job", "session", "batch-1-decode-step", "lease-hang-watchdog"],
)
async def test_kill_mid_generation_every_stream_completes_token_exact(solo, actor, kind, batch) -> None:
    """8 greedy streams survive the fault and equal their undisturbed runs; status counts the restart."""
    async with open_engine(str(tiny_model(LLAMA)), batch=batch, step_watchdog_s=0.5) as engine:
        streams = await _run_streams(engine, lambda: engine.faults.arm(actor, kind), after=1 if batch == 4 else 8)
        assert streams == solo
        assert engine.faults.fired, "the fault never fired"
        await _wait_healthy(engine)
        status = engine.status()["tree"]
        restarted = {"gpu-lease": "gpu-lease" if kind == "hang" else "decode-step"}.get(actor, actor)
        if actor != "session":
            node = _node(status, restarted)
            assert node is not None and node["restarts"] >= 1, status


async def test_kill_prefill_of_a_long_prompt_then_twice_in_a_row(solo) -> None:
    """Prefill dies mid-prompt (twice): the request resumes and the others are untouched."""
    long_prompt = " ".join(["the sea and the wind"] * 30)
    async with open_engine(str(tiny_model(LLAMA)), batch=1) as probe:
        expected_long = (await probe.complete(long_prompt, max_tokens=MAX_TOKENS)).token_ids
    async with open_engine(str(tiny_model(LLAMA)), batch=8, prefill_step_size=16) as engine:
        engine.faults.arm("prefill", "raise")
        engine.faults.arm("prefill", "raise")
        results: dict[str, tuple[int, ...]] = {}

        async def one(name: str, prompt: str) -> None:
            results[name] = (await engine.complete(prompt, max_tokens=MAX_TOKENS)).token_ids

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "long", long_prompt)
            nursery.start_soon(one, "short", PROMPTS[0])
        assert len(engine.faults.fired) == 2
        await _wait_healthy(engine)
        assert _node(engine.status()["tree"], "prefill")["restarts"] == 2
    assert results == {"long": expected_long, "short": solo[0]}


async def test_an_engine_that_gives_up_is_down_then_started_again_and_serves(solo: list[tuple[int, ...]]) -> None:
    """Past the intensity the engine subtree gives up; the process lives on, refuses new work, comes back.

    While down: health says why, a new request is refused at once with `EngineDown` (HTTP 503 +
    Retry-After) instead of waiting out resume_timeout_s. Then the root starts the engine again
    and the same prompt gives the same greedy tokens.
    """
    with trio.fail_after(60):
        async with open_engine(str(tiny_model(LLAMA)), batch=8, max_restarts=1) as engine:
            for _ in range(2):  # the second crash within the period exceeds max_restarts=1
                engine.faults.arm("decode-step", "raise")

            async def one(i: int) -> None:
                with contextlib.suppress(MlxTrioError):
                    await engine.complete(PROMPTS[i], max_tokens=MAX_TOKENS)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
                while engine.actors.retrying.down is None:
                    await trio.sleep(0.01)
                ok, reason = engine.health()
                assert not ok and reason.startswith("engine down: ") and "'engine' gave up" in reason
                with pytest.raises(EngineDown) as info:
                    await engine.complete(PROMPTS[0], max_tokens=MAX_TOKENS)
                assert 0 < info.value.retry_after_s <= 1.0
            await _wait_healthy(engine)
            assert engine.actors.retrying.retries == 1 and engine.actors.retrying.down is None
            assert (await engine.complete(PROMPTS[0], max_tokens=MAX_TOKENS)).token_ids == solo[0]
            assert _node(engine.status()["tree"], "engine")["state"] == "running"


@pytest.mark.parametrize("batch", [1, 8], ids=["batch-1", "batch-8"])
async def test_a_seeded_stream_resumes_its_random_sequence_exactly(batch: int) -> None:
    """A seeded sampled stream killed mid-way continues from its PRNG state: same tokens as undisturbed."""
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.9, "top_k": 20, "seed": 5}
    async with open_engine(str(tiny_model(LLAMA)), batch=batch) as engine:
        undisturbed = (await engine.complete(PROMPTS[1], **params)).token_ids
        got: list[int] = []
        async for event in engine.generate(PROMPTS[1], **params):
            if isinstance(event, TextDelta):
                got.extend(event.token_ids)
                if len(got) >= 5 and not engine.faults.fired and not engine.faults.armed():
                    engine.faults.arm("decode-step", "raise")
        assert engine.faults.fired
    assert tuple(got) == undisturbed


@pytest.mark.parametrize("kind", ["raise", "fail-write"])
async def test_a_failed_or_killed_ssd_write_loses_no_request_and_leaves_no_partial_file(solo, tmp_path, kind) -> None:
    """The cache-persistence actor dies (or one write fails) mid-write: streams are untouched, files stay whole."""
    async with open_engine(str(tiny_model(LLAMA)), batch=8, prompt_cache_dir=tmp_path) as engine:
        engine.faults.arm("cache-persistence", kind)
        streams = await _run_streams(engine, lambda: None)
        assert streams == solo
        # A lone row always hands its caches to the prompt cache, which offers them to the SSD tier.
        await engine.complete(" ".join(["the sea and the wind"] * 20), max_tokens=4)
        with trio.fail_after(20):
            while not engine.faults.fired:
                await trio.sleep(0.01)
            await engine.drain_persistence()
        await _wait_healthy(engine)
        node = _node(engine.status()["tree"], "cache-persistence")
        ssd = engine.status()["prompt_cache"]["ssd"]
        assert node is not None and node["restarts"] == (1 if kind == "raise" else 0)
        assert kind == "raise" or ssd["errors"] == 1
        again = (await engine.complete(PROMPTS[0], max_tokens=MAX_TOKENS)).token_ids
        await engine.drain_persistence()
    assert again == solo[0]
    assert not list(tmp_path.rglob("*.tmp*"))
    async with open_engine(str(tiny_model(LLAMA)), batch=8, prompt_cache_dir=tmp_path) as engine:
        assert (await engine.complete(PROMPTS[0], max_tokens=MAX_TOKENS)).token_ids == solo[0]
        assert engine.status()["prompt_cache"]["ssd"]["errors"] == 0


@pytest.mark.parametrize("batch", [1, 8], ids=["batch-1", "batch-8"])
async def test_a_constrained_stream_resumes_its_grammar_where_it_stood(batch: int) -> None:
    """A JSON-schema stream killed mid-object continues the object: same tokens as undisturbed, valid JSON."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["name", "n"], "additionalProperties": False}
    params = {"max_tokens": 60, "temperature": 0.9, "seed": 3,
              "constraint": Constraint("json_schema", json.dumps(schema))}
    async with open_engine(str(tiny_model(LLAMA)), batch=batch) as engine:
        undisturbed = await engine.complete(PROMPTS[2], **params)
        got: list[int] = []
        text: list[str] = []
        async for event in engine.generate(PROMPTS[2], **params):
            if isinstance(event, TextDelta):
                got.extend(event.token_ids)
                text.append(event.text)
                if len(got) >= 4 and not engine.faults.fired and not engine.faults.armed():
                    engine.faults.arm("decode-step", "raise")
        assert engine.faults.fired
    assert undisturbed.finish_reason == "stop" and tuple(got) == undisturbed.token_ids
    assert set(json.loads("".join(text))) == {"name", "n"}


async def test_rapid_kills_never_strand_a_request(solo) -> None:
    """Kills every 0.6 s for 4 s under 24 clients: every request ends with its undisturbed tokens, none hangs.

    A restart can cancel the prefill actor half-way through handing on a cohort of
    prefilled rows; each request it had taken must still end (and resume).
    """
    rng = random.Random(7)
    done = wrong = 0
    with trio.fail_after(90):
        async with open_engine(str(tiny_model(LLAMA)), batch=8, max_restarts=10_000, restart_period_s=1.0) as engine:
            async def client(i: int, deadline: float) -> None:
                nonlocal done, wrong
                while trio.current_time() < deadline:
                    k = (i + done) % len(PROMPTS)
                    got = (await engine.complete(PROMPTS[k], max_tokens=MAX_TOKENS)).token_ids
                    done += 1
                    wrong += got != solo[k]

            async def killer(deadline: float) -> None:
                while trio.current_time() < deadline:
                    # None of these is a request's own failure, so none counts against its resumes
                    # (the resume rule: tests/faults/test_resume_rule.py has them in a row, on purpose).
                    await trio.sleep(0.6)
                    engine.faults.arm(rng.choice(["decode-step", "prefill", "admission"]), "raise")

            deadline = trio.current_time() + 4.0
            async with trio.open_nursery() as nursery:
                for i in range(24):
                    nursery.start_soon(client, i, deadline)
                nursery.start_soon(killer, deadline)
            await _wait_healthy(engine)
    assert done > 24 and wrong == 0


async def test_a_hung_lease_job_with_work_waiting_makes_health_say_so_before_the_watchdog(solo) -> None:
    """A hang in the lease with streams waiting: /health's reason is "gpu-lease stalled" within the stall share
    of the watchdog; then the watchdog restarts the lease, every stream finishes exact, and health is ok again."""
    async with open_engine(str(tiny_model(LLAMA)), batch=8, step_watchdog_s=4.0) as engine:
        reasons: list[str] = []

        async def watch_health() -> None:
            while True:
                reasons.append(engine.health()[1])
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_health)
            streams = await _run_streams(engine, lambda: engine.faults.arm("gpu-lease", "hang"), after=4)
            nursery.cancel_scope.cancel()
        assert streams == solo
        assert any(reason.startswith("gpu-lease stalled") for reason in reasons), sorted(set(reasons))
        await _wait_healthy(engine)


def test_a_fault_that_can_never_fire_at_an_actor_is_refused_when_armed() -> None:
    """`hang` fires only where a job can hang (the lease, the SSD writer); `fail-write` only at cache-persistence."""
    from mlx_trio.supervision.faults import Faults  # noqa: PLC0415

    faults = Faults()
    for actor, kind in (("decode-step", "hang"), ("prefill", "hang"), ("session", "hang"), ("gpu-lease", "fail-write")):
        with pytest.raises(ValueError, match="fires only at"):
            faults.arm(actor, kind)
    assert faults.armed() == []
    faults.arm("gpu-lease", "hang")
    faults.arm("cache-persistence", "hang")
    faults.arm("decode-step", "raise")
    assert len(faults.armed()) == 3
