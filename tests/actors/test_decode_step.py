"""DecodeStepActor alone (a real lease, a tiny model, prefilled rows handed in): tokens, endings, releases."""

from __future__ import annotations

from functools import partial

import trio
import trio.testing

from mlx_trio.actors.decode_step import DecodeStepActor
from mlx_trio.actors.gpu_lease import open_gpu_lease
from mlx_trio.actors.lane import Lane
from mlx_trio.actors.messages import DecodeEvent, Generate, GenerationEnded, JoinRow, TokensDecoded
from mlx_trio.config import EngineConfig
from mlx_trio.engine.batch.solo_row import SoloRow
from mlx_trio.engine.lease_thread import release_thread_streams, thread_default_stream
from mlx_trio.engine.model.load import load_model
from mlx_trio.events import FinishReason
from mlx_trio.params import SamplingParams
from mlx_trio.supervision.faults import Faults
from mlx_trio.testing.tiny_models import LLAMA, tiny_model
from tests.engine.batch.batch_driver import solo_run
from tests.actors.lane_fakes import RecordingAdmission


def _prefilled(model, rid: str, prompt: tuple[int, ...], params: SamplingParams) -> SoloRow:
    row = SoloRow(model, rid, prompt, params, prefill_step_size=8)
    while row.prefill_chunk():
        pass
    row.first_token()
    return row


async def test_rows_decode_their_solo_tokens_end_once_and_release_on_leaving() -> None:
    """Two rows (max_tokens 6 and 11): each gets exactly its tokens alone, then GenerationEnded(LENGTH),
    then a closed reply; both reservations are released and the batch holds no KV."""
    async with open_gpu_lease(on_thread_start=thread_default_stream, on_thread_exit=release_thread_streams) as lease:
        loaded = await lease.run(partial(load_model, str(tiny_model(LLAMA))))
        eos = set(loaded.eos_token_ids)
        lane = Lane(EngineConfig(batch=4), Faults())
        lane.lease, lane.admission = lease, RecordingAdmission()  # type: ignore[assignment]
        lane.settle_model(loaded)
        lane.decode_step = actor = DecodeStepActor(lane, lease)
        cases = {"a": ((5, 9, 44, 3, 17), SamplingParams(max_tokens=6)),
                 "b": ((8, 8, 21, 60, 7, 7, 30, 2, 11), SamplingParams(max_tokens=11))}
        expected = {rid: (await lease.run(partial(solo_run, loaded.model, prompt, params, eos=eos))).tokens
                    for rid, (prompt, params) in cases.items()}
        events: dict[str, list[DecodeEvent]] = {}
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            replies = {}
            for rid, (prompt, params) in cases.items():
                send, replies[rid] = trio.open_memory_channel[DecodeEvent](64)
                row = await lease.run(partial(_prefilled, loaded.model, rid, prompt, params))
                await actor.join_send.send(JoinRow(Generate(rid, prompt, params, send), row, row.token0))
            with trio.fail_after(30):
                for rid, recv in replies.items():
                    events[rid] = [event async for event in recv]  # ends only when the reply is closed
                while actor.decoding:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    for rid, (_, params) in cases.items():
        *tokens, last = events[rid]
        decoded = [t for event in tokens if isinstance(event, TokensDecoded) for t in event.token_ids]
        assert [expected[rid][0], *decoded] == expected[rid]
        assert last == GenerationEnded(rid, FinishReason.LENGTH)
    assert sorted(lane.admission.released) == ["a", "b"]  # type: ignore[union-attr]
    assert actor.statistics().kv_bytes == 0 and actor.statistics().finished == 2


async def test_an_idle_decoder_joins_every_row_already_sent_in_one_settle(monkeypatch) -> None:
    """A cohort's rows handed on together (no checkpoint between the sends) join the idle batch in one
    membership job, not the first alone and the rest after whatever job the lease runs next."""
    from mlx_trio.actors import decode_step

    joined: list[int] = []

    def recording(batch, leaving, puts, joiners):  # type: ignore[no-untyped-def]
        if joiners:
            joined.append(len(joiners))
        return membership(batch, leaving, puts, joiners)

    membership = decode_step._membership
    monkeypatch.setattr(decode_step, "_membership", recording)
    async with open_gpu_lease(on_thread_start=thread_default_stream, on_thread_exit=release_thread_streams) as lease:
        loaded = await lease.run(partial(load_model, str(tiny_model(LLAMA))))
        lane = Lane(EngineConfig(batch=4), Faults())
        lane.lease, lane.admission = lease, RecordingAdmission()  # type: ignore[assignment]
        lane.settle_model(loaded)
        lane.decode_step = actor = DecodeStepActor(lane, lease)
        params = SamplingParams(max_tokens=3)
        prompts = {rid: (5 + i, 9, 44, 3 * i + 1) for i, rid in enumerate("abc")}
        rows = {rid: await lease.run(partial(_prefilled, loaded.model, rid, prompt, params))
                for rid, prompt in prompts.items()}
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            await trio.testing.wait_all_tasks_blocked()  # the decoder waits for its first row
            replies = {}
            for rid, prompt in prompts.items():
                send, replies[rid] = trio.open_memory_channel[DecodeEvent](64)
                actor.join_send.send_nowait(JoinRow(Generate(rid, prompt, params, send), rows[rid], rows[rid].token0))
            with trio.fail_after(30):
                for recv in replies.values():
                    _ = [event async for event in recv]
            nursery.cancel_scope.cancel()
    assert joined == [3]
