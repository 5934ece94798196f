"""The engine link on its own: frames, errors, and `RemoteEngine` against `LinkServer` over a real Unix socket.

The engine behind the link is the HTTP tests' `FakeEngine` (no model), so
each test says exactly what the front must see.
"""

from __future__ import annotations

import pickle
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from tests.http.fakes import FakeEngine

from mlx_trio.errors import (ContextTooLong, EngineDown, EngineFailure, InvalidParameter, ModelNotFound,
                             Overloaded)
from mlx_trio.events import Finished, TextDelta, Usage
from mlx_trio.http.responses.store import StoredResponse
from mlx_trio.link.link_server import LinkServer
from mlx_trio.link import remote_engine
from mlx_trio.link.remote_engine import RemoteEngine
from mlx_trio.link.wire import FrameReader, LinkClosed, frame


class _Chunks(trio.abc.ReceiveStream):
    """A stream that hands out `data` in the given chunk sizes."""

    def __init__(self, data: bytes, sizes: list[int]) -> None:
        self._data, self._sizes = data, sizes

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        n = self._sizes.pop(0) if self._sizes else len(self._data)
        out, self._data = self._data[:n], self._data[n:]
        return out

    async def aclose(self) -> None:
        pass


@given(st.lists(st.tuples(st.sampled_from(["event", "ok"]), st.integers(0, 2**31), st.text(max_size=50)),
                min_size=1, max_size=5),
       st.lists(st.integers(1, 7), max_size=40))
def test_frames_survive_any_split_of_the_byte_stream(messages: list[tuple[str, int, str]], sizes: list[int]) -> None:
    """Two frames sent back to back come out whole and in order, however the reads cut the bytes."""
    async def main() -> None:
        reader = FrameReader(_Chunks(frame(messages) + frame(messages[::-1]), sizes))
        assert await reader.receive() == messages
        assert await reader.receive() == messages[::-1]
        with pytest.raises(LinkClosed):
            await reader.receive()

    trio.run(main)


@pytest.mark.parametrize("error", [InvalidParameter("temperature", "must be >= 0"),
                                   ContextTooLong("prompt is too long: 9 tokens > 8 maximum", field="prompt"),
                                   ModelNotFound("nope", ("base", "lora-a")), Overloaded("queue full", 2.5),
                                   EngineDown("restarting", 3.0)])
def test_errors_cross_the_link_as_themselves(error: Exception) -> None:
    """Type, message and every attribute (the field an HTTP error names, Retry-After) survive pickling."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error) and back.args == error.args
    assert back.__dict__ == error.__dict__


@asynccontextmanager
async def linked(tmp_path: Path, engine: FakeEngine) -> AsyncIterator[tuple[RemoteEngine, LinkServer, Any]]:
    """A `LinkServer` serving `engine` and a connected `RemoteEngine`; yields both and the server's scope."""
    server = LinkServer(engine, str(tmp_path / "engine.sock"))  # type: ignore[arg-type]
    remote = RemoteEngine(server.path)
    async with trio.open_nursery() as nursery:
        server_scope = trio.CancelScope()
        server.ended = trio.Event()  # type: ignore[attr-defined]

        async def serve() -> None:
            with server_scope:
                await server.run()
            server.ended.set()  # type: ignore[attr-defined]

        nursery.start_soon(serve)
        await nursery.start(remote.run)
        with trio.fail_after(5):
            await remote.connected.wait()
            while remote.health() != engine.health():
                await trio.sleep(0.01)
        yield remote, server, server_scope
        nursery.cancel_scope.cancel()


async def _direct(engine: FakeEngine, prompt: str, **kwargs: Any) -> list[Any]:
    return [event async for event in engine.stream(engine.prepare(prompt, **kwargs))]


async def test_a_stream_through_the_link_is_the_engine_stream(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with linked(tmp_path, engine) as (remote, _, _):
        request = await remote.prepare_off_loop("a b c", max_tokens=5)
        events = [event async for event in remote.stream(request)]
    assert events == await _direct(FakeEngine(), "a b c", max_tokens=5)
    assert isinstance(events[-1], Finished) and sum(isinstance(e, TextDelta) for e in events) == 5


async def test_the_engine_error_of_a_call_is_raised_in_the_front(tmp_path: Path) -> None:
    engine = FakeEngine(context_length=4)
    async with linked(tmp_path, engine) as (remote, _, _):
        with pytest.raises(InvalidParameter) as bad:
            await remote.prepare_off_loop("hi", temperature=-1.0)
        assert bad.value.field == "temperature"
        with pytest.raises(ContextTooLong):
            await remote.prepare_off_loop("one two three four five six")
        # The link serves on after an error.
        assert await trio.to_thread.run_sync(lambda: remote.count_tokens("a b c")) == engine.count_tokens("a b c")


async def test_leaving_a_stream_early_cancels_it_in_the_engine(tmp_path: Path) -> None:
    engine = FakeEngine()
    engine.token_delay_s = 0.01
    async with linked(tmp_path, engine) as (remote, server, _):
        events = remote.stream(await remote.prepare_off_loop("x", max_tokens=1000))
        got = 0
        async for event in events:
            got += isinstance(event, TextDelta)
            if got == 3:
                break
        await events.aclose()
        with trio.fail_after(5):
            while engine.closed_streams < 1 or server.streams:
                await trio.sleep(0.01)
        assert engine.active == 0


@attrs.frozen
class _Request:
    request_id: str
    tokens: int


class ReplayingEngine(FakeEngine):
    """Streams token i as "w{i} "; `replay` (chunks of ids) comes first, one TextDelta a chunk, as `Engine.stream`
    gives it, and the stream goes on after it. Records the request ids it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.token_delay_s = 0.01
        self.ids: list[str] = []

    async def prepare_off_loop(self, prompt: Any, **kwargs: Any) -> _Request:  # type: ignore[override]
        return _Request(f"req-{len(self.ids) + 1}", kwargs.get("max_tokens", 8))

    async def stream(self, request: _Request, replay: Any = ()) -> Any:  # type: ignore[override]
        self.ids.append(request.request_id)
        for chunk in replay:
            yield TextDelta("".join(f"w{i} " for i in chunk), tuple(chunk))
        for i in range(sum(len(c) for c in replay), request.tokens):
            await trio.sleep(self.token_delay_s)
            yield TextDelta(f"w{i} ", (i,))
        yield Finished("length", Usage(1, request.tokens))


async def _collect(remote: Any, request: Any, seen: list[Any]) -> None:
    """Read `request`'s stream from `remote` into `seen` (a resumed stream too)."""
    async for event in remote.stream(request):
        seen.append(event)


async def _until_finished(seen: list[Any]) -> None:
    with trio.fail_after(10):
        while not seen or not isinstance(seen[-1], Finished):
            await trio.sleep(0.01)


async def test_a_stream_resumes_on_the_next_engine_when_the_link_breaks(tmp_path: Path) -> None:
    """The caller sees one stream, each token once; the resumed attempt has an id of its own."""
    engine = ReplayingEngine()
    async with linked(tmp_path, engine) as (remote, server, server_scope):
        request = await remote.prepare_off_loop("x", max_tokens=12)
        seen: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_collect, remote, request, seen)
            with trio.fail_after(5):
                while len(seen) < 4:
                    await trio.sleep(0.001)
            server_scope.cancel()  # the engine's side goes away mid-stream
            await server.ended.wait()
            with trio.fail_after(5):
                while remote.health()[0]:
                    await trio.sleep(0.001)
            with pytest.raises(EngineDown):  # what changes the engine is not sent again
                await remote.load_adapter("a", "/nowhere")
            nursery.start_soon(LinkServer(engine, server.path).run)  # type: ignore[arg-type]
            await _until_finished(seen)
            nursery.cancel_scope.cancel()
    texts = [e.text for e in seen if isinstance(e, TextDelta)]
    assert "".join(texts) == "".join(f"w{i} " for i in range(12))
    assert [i for e in seen if isinstance(e, TextDelta) for i in e.token_ids] == list(range(12))
    assert engine.ids == ["req-1", "req-1.r1"]


async def test_a_call_waits_for_the_engine_and_is_sent_again(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with linked(tmp_path, engine) as (remote, server, server_scope):
        server_scope.cancel()
        await server.ended.wait()
        with trio.fail_after(5):
            while remote.health()[0]:
                await trio.sleep(0.001)
        async with trio.open_nursery() as nursery:
            counted: list[int] = []

            async def count() -> None:
                counted.append(await trio.to_thread.run_sync(lambda: remote.count_tokens("a b c")))

            nursery.start_soon(count)
            await trio.sleep(0.2)
            assert counted == []  # waits for an engine
            nursery.start_soon(LinkServer(engine, server.path).run)  # type: ignore[arg-type]
            with trio.fail_after(10):
                while not counted:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert counted == [engine.count_tokens("a b c")]


async def test_facts_and_status_follow_the_engine(tmp_path: Path) -> None:
    engine = FakeEngine(loaded=False)
    async with linked(tmp_path, engine) as (remote, _, _):
        assert remote.health() == (False, "loading model")
        with pytest.raises(EngineFailure):
            remote.model_id  # noqa: B018
        assert not remote.model_known.is_set()  # the front freezes its objects only once the model is named
        engine.loaded = True
        with trio.fail_after(5):
            await remote.model_known.wait()
            while not remote.health()[0]:
                await trio.sleep(0.01)
        assert remote.model_id == engine.model_id and remote.context_length == engine.context_length
        assert remote.output_format == engine.output_format and remote.served_adapters() == ()
        remote.local_status = lambda: {"id": "front-0", "kind": "supervisor", "children": [{"id": "http"}]}
        remote.status()
        with trio.fail_after(5):
            while remote.status()["counters"].get("kv_bytes") is None:
                await trio.sleep(0.01)
        status = remote.status()
        assert status["model"] == "fake"
        assert status["tree"]["children"] == [{"id": "http", "front": "front-0"}]


async def test_faults_of_engine_actors_are_armed_in_the_engine_and_http_ones_here(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with linked(tmp_path, engine) as (remote, _, _):
        remote.faults.arm("decode-step", "raise")
        remote.faults.arm("http", "raise")
        with trio.fail_after(5):
            while not engine.faults.armed():
                await trio.sleep(0.01)
        assert [(f.actor, f.kind.value) for f in engine.faults.armed()] == [("decode-step", "raise")]
        assert remote.faults.take("http", remote.faults.armed()[0].kind)
        with pytest.raises(ValueError):
            remote.faults.arm("decode-step", "no-such-kind")


def _stored(response_id: str, text: str) -> StoredResponse:
    item = {"id": f"msg_{response_id}", "type": "message", "role": "user", "content": text}
    return StoredResponse({"id": response_id, "object": "response", "output": []}, (item,), (item,))


def test_a_stored_response_pickles_as_itself() -> None:
    entry = _stored("resp_1", "héllo")
    back = pickle.loads(pickle.dumps(entry))
    assert back == entry and back.nbytes == entry.nbytes and type(back.input_items[0]) is dict


async def test_fronts_share_the_engine_process_responses_store(tmp_path: Path) -> None:
    """Stored through one front, read and deleted through another: the store is the link server's."""
    engine = FakeEngine()
    async with linked(tmp_path, engine) as (first, server, _):
        second = RemoteEngine(server.path)
        async with trio.open_nursery() as nursery:
            await nursery.start(second.run)
            with trio.fail_after(5):
                await second.connected.wait()
            entry = _stored("resp_a", "one")
            assert await first.responses_store.put(entry) is True
            # The put returned: the entry is in the engine's store already (no waiting for it).
            assert server.responses.get("resp_a") == entry
            assert await second.responses_store.get("resp_a") == entry
            assert await second.responses_store.get("resp_none") is None
            assert await second.responses_store.delete("resp_a") is True
            assert await first.responses_store.get("resp_a") is None
            assert await first.responses_store.delete("resp_a") is False
            nursery.cancel_scope.cancel()


async def test_the_shared_store_evicts_as_the_local_one_does(tmp_path: Path) -> None:
    """Sized by `responses_store_bytes`: the least recently used go first, and one too large is not kept."""
    entries = [_stored(f"resp_{i}", "x" * 50) for i in range(3)]
    size = entries[0].nbytes
    server = LinkServer(FakeEngine(), str(tmp_path / "engine.sock"),  # type: ignore[arg-type]
                        responses_store_bytes=2 * size)
    remote = RemoteEngine(server.path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        await nursery.start(remote.run)
        with trio.fail_after(5):
            await remote.connected.wait()
        store = remote.responses_store
        assert await store.put(entries[0]) and await store.put(entries[1])
        assert await store.get("resp_0") == entries[0]  # now resp_1 is the least recently used
        assert await store.put(entries[2])
        assert [await store.get(f"resp_{i}") for i in range(3)] == [entries[0], None, entries[2]]
        assert await store.put(_stored("resp_big", "x" * (3 * size))) is False
        assert await store.get("resp_big") is None and len(server.responses) == 2
        nursery.cancel_scope.cancel()


async def test_the_store_waits_for_the_link_then_fails_retryably(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Get and put wait for an engine (they are sent again after a break) up to the resume wait; delete does not."""
    monkeypatch.setattr(remote_engine, "RESUME_WAIT_S", 0.3)
    remote = RemoteEngine(str(tmp_path / "nobody.sock"))
    start = trio.current_time()
    with pytest.raises(EngineDown):
        await remote.responses_store.get("resp_a")
    assert trio.current_time() - start >= 0.3
    start = trio.current_time()
    with pytest.raises(EngineDown):
        await remote.responses_store.delete("resp_a")
    assert trio.current_time() - start < 0.3


def _recording_ops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ops the link server is sent from now on, in order."""
    from mlx_trio.link import link_server

    ops: list[str] = []
    dispatch = link_server._FrontSession._dispatch

    def recorded(self: Any, op: str, mid: int, payload: Any) -> None:
        ops.append(op)
        dispatch(self, op, mid, payload)

    monkeypatch.setattr(link_server._FrontSession, "_dispatch", recorded)
    return ops


async def test_prepare_and_stream_cross_the_link_once_and_no_cancel_follows_a_finish(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One `generate` carries the prompt; its answer is the prepared request, its events follow. A caller
    that stops reading at `Finished` (before the stream's end message) sends no `cancel`."""
    ops = _recording_ops(monkeypatch)
    engine = FakeEngine()
    async with linked(tmp_path, engine) as (remote, server, _):
        request = await remote.prepare_off_loop("a b c", max_tokens=5)
        events = []
        stream = remote.stream(request)
        async for event in stream:
            events.append(event)
            if isinstance(event, Finished):
                break
        await stream.aclose()
        with trio.fail_after(5):
            while server.streams:
                await trio.sleep(0.01)
        await trio.sleep(0.05)  # a cancel, if one were sent, would be in by now
    assert events == await _direct(FakeEngine(), "a b c", max_tokens=5)
    assert [op for op in ops if op != "status"] == ["generate"]
    assert len(engine.prepared) == 1


async def test_a_prepared_request_nobody_streams_is_cancelled_in_the_engine(tmp_path: Path) -> None:
    import gc

    engine = FakeEngine()
    engine.token_delay_s = 0.01
    async with linked(tmp_path, engine) as (remote, server, _):
        request = await remote.prepare_off_loop("x", max_tokens=1000)
        with trio.fail_after(5):
            while not engine.active:
                await trio.sleep(0.01)
        del request
        gc.collect()
        with trio.fail_after(5):
            while engine.active or server.streams:
                await trio.sleep(0.01)


class GroupLosingEngine(ReplayingEngine):
    """A rank 0 whose group is lost after `lose_after` tokens of its first stream: that stream then fails
    (as `Engine.stream` does once `group_lost` is set) and so would every later one."""

    def __init__(self, lose_after: int) -> None:
        super().__init__()
        self.lose_after = lose_after

    async def stream(self, request: _Request, replay: Any = ()) -> Any:  # type: ignore[override]
        if self.group_lost is not None:
            raise EngineDown(f"scale-out group lost: {self.group_lost}")
        async for event in super().stream(request, replay):
            yield event
            if isinstance(event, TextDelta) and event.token_ids[-1] + 1 == self.lose_after:
                self.group_lost = "a follower was lost"
                raise EngineDown("scale-out group lost: a follower was lost")


async def test_a_stream_of_a_lost_group_resumes_on_the_next_engine_with_no_error(tmp_path: Path) -> None:
    """The engine ends the stream with `lost` (not its error); the front does not resume on that engine,
    whose link is still up, but on the next one: the caller sees one stream, each token once."""
    engine = GroupLosingEngine(lose_after=4)
    async with linked(tmp_path, engine) as (remote, server, server_scope):
        request = await remote.prepare_off_loop("x", max_tokens=12)
        seen: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_collect, remote, request, seen)
            with trio.fail_after(5):
                while engine.group_lost is None:
                    await trio.sleep(0.001)
            await trio.sleep(0.3)  # the old engine stays linked a while (the launcher is ending it)
            assert engine.ids == ["req-1"] and not isinstance(seen[-1], Finished)
            server_scope.cancel()
            await server.ended.wait()
            nxt = ReplayingEngine()
            nursery.start_soon(LinkServer(nxt, server.path).run)  # type: ignore[arg-type]
            await _until_finished(seen)
            nursery.cancel_scope.cancel()
    assert [i for e in seen if isinstance(e, TextDelta) for i in e.token_ids] == list(range(12))
    assert engine.ids == ["req-1"] and nxt.ids == ["req-1.r1"]


async def test_the_output_format_crosses_pickled_and_is_unpickled_only_when_read(tmp_path: Path) -> None:
    """Unpickling a real model's format imports mlx-lm: the launcher's link, which never reads it, holds no MLX."""
    engine = FakeEngine()
    async with linked(tmp_path, engine) as (remote, _, _):
        assert isinstance(remote._facts["output_format"], bytes) and remote._format is None
        assert remote.output_format == engine.output_format
