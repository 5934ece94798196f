"""The lane record: one lane at every --batch, wired in one place, rewired by restarts; `end_request`."""

from __future__ import annotations

import ast
from pathlib import Path

import trio

import mlx_trio.actors
from mlx_trio import open_engine
from mlx_trio.actors.lane import Lane
from mlx_trio.actors.messages import DecodeEvent, Generate, GenerationEnded, TokensDecoded
from mlx_trio.config import EngineConfig
from mlx_trio.events import FinishReason
from mlx_trio.params import SamplingParams
from mlx_trio.supervision.faults import Faults
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.prompts import PROMPTS
from tests.actors.lane_fakes import RecordingAdmission


def _wiring(engine) -> dict[str, object]:
    """Who each actor talks to, by identity: the lane record and the channels between actors."""
    lane = engine.actors.lane
    return {
        "decode-step lane": lane.decode_step._lane, "prefill lane": lane.prefill._lane,
        "admission lane": lane.admission._lane,
        "prefill → decode-step": lane.prefill._join is lane.decode_step.join_send,
        "admission → prefill": lane.admission._prefill is lane.prefill.inbox_send,
        "lease": (lane.decode_step._lease is lane.lease, lane.prefill._lease is lane.lease),
    }


async def test_batch_1_is_the_lane_with_a_row_cap_of_one() -> None:
    """--batch 1: admission, prefill and decode-step run; three concurrent requests never share a row."""
    async with open_engine(str(tiny_model(LLAMA)), batch=1) as engine:
        lane = engine.actors.lane
        assert lane.row_cap == 1 and lane.admission.statistics().max_rows == 1
        assert _wiring(engine) == {
            "decode-step lane": lane, "prefill lane": lane, "admission lane": lane,
            "prefill → decode-step": True, "admission → prefill": True, "lease": (True, True),
        }
        most = 0

        async def one(prompt: str) -> None:
            await engine.complete(prompt, max_tokens=12)

        async with trio.open_nursery() as nursery:
            for prompt in PROMPTS[:3]:
                nursery.start_soon(one, prompt)
            while lane.admission.statistics().submitted < 3 or lane.in_flight() or lane.admission.statistics().mailbox_depth:
                most = max(most, len(lane.in_flight()), lane.decode_step.statistics().active_rows)
                await trio.sleep(0)
        assert most == 1
        assert engine.status()["counters"]["mode"] == "serial"
        assert lane.caching is None  # --batch 1 takes no prompt from another request's cached KV


async def test_a_restart_rewires_the_new_actors_into_the_same_lane() -> None:
    """Killing decode-step restarts it, prefill and admission (rest_for_one): new objects, same wiring."""
    async with open_engine(str(tiny_model(LLAMA)), batch=4) as engine:
        lane = engine.actors.lane
        before = (lane.decode_step, lane.prefill, lane.admission)
        first = await engine.complete(PROMPTS[0], max_tokens=16)
        engine.faults.arm("decode-step", "raise")
        again = await engine.complete(PROMPTS[0], max_tokens=16)
        with trio.fail_after(10):
            while not engine.health()[0]:
                await trio.sleep(0.01)
        after = (lane.decode_step, lane.prefill, lane.admission)
        assert engine.faults.fired and all(a is not b for a, b in zip(after, before))
        assert _wiring(engine) == {
            "decode-step lane": lane, "prefill lane": lane, "admission lane": lane,
            "prefill → decode-step": True, "admission → prefill": True, "lease": (True, True),
        }
        assert again.token_ids == first.token_ids


class _Lease:
    def __init__(self) -> None:
        self.freed: list[object] = []

    def free_nowait(self, close: object) -> None:
        self.freed.append(close)


class _Row:
    def close(self) -> None:
        pass


def _lane() -> tuple[Lane, _Admission, _Lease]:
    lane = Lane(EngineConfig(batch=2), Faults())
    admission, lease = RecordingAdmission(), _Lease()
    lane.admission, lane.lease = admission, lease  # type: ignore[assignment]
    return lane, admission, lease


async def test_end_request_sends_the_last_word_closes_releases_and_frees() -> None:
    lane, admission, lease = _lane()
    send, recv = trio.open_memory_channel[DecodeEvent](4)
    request = Generate("r1", (1, 2), SamplingParams(), send)
    send.send_nowait(TokensDecoded("r1", (7,)))
    row = _Row()
    lane.end_request(request, GenerationEnded("r1", FinishReason.LENGTH), row=row)
    lane.end_request(request, GenerationEnded("r1", FinishReason.STOP))  # a second end changes nothing for the session
    assert [event async for event in recv] == [TokensDecoded("r1", (7,)), GenerationEnded("r1", FinishReason.LENGTH)]
    assert admission.released == ["r1", "r1"] and lease.freed == [row.close]


async def test_end_request_of_a_request_whose_session_left_still_releases() -> None:
    lane, admission, _ = _lane()
    send, recv = trio.open_memory_channel[DecodeEvent](4)
    recv.close()  # the caller went away
    lane.end_request(Generate("r2", (1,), SamplingParams(), send), GenerationEnded("r2", FinishReason.STOP))
    assert admission.released == ["r2"]


def test_only_end_request_closes_a_reply_channel() -> None:
    """`Generate.reply` has one closer (its docstring says so): no other actor code calls `.reply.close()`."""
    closers = []
    for path in sorted(Path(mlx_trio.actors.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "close"
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "reply"):
                closers.append(path.name)
    assert closers == ["lane.py"]
