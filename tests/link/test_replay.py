"""What a front's resume stands on (link/remote_engine.py), on a tiny real model: `Engine.stream` of a
request sent again with the chunks its client already has (`replay`) yields those chunks first, then
exactly the rest of the uninterrupted stream, whatever chunk the cut came after: greedy, seeded
sampled, with a stop string and with logprobs. (Ported from the proxy front's rank-0 replay test:
the replay moved below HTTP, so the wire APIs above it need no test of their own.)"""

from __future__ import annotations

from typing import Any

import pytest

from mlx_trio import open_engine
from mlx_trio.events import Finished, TextDelta
from mlx_trio.testing.tiny_models import LLAMA, tiny_model

CASES = {
    "greedy": {"max_tokens": 20, "temperature": 0.0},
    "seeded": {"max_tokens": 20, "temperature": 1.0, "seed": 7},
    "stop": {"max_tokens": 20, "temperature": 0.0, "stop": ["zzz-never"]},
    "logprobs": {"max_tokens": 20, "temperature": 0.0, "logprobs": True, "top_logprobs": 2},
}


def _whole(events: list[Any]) -> tuple[Any, ...]:
    """The stream as its client reads it: every token id, the text, the logprobs, the finish (how the
    tokens were grouped into deltas depends on timing: the session coalesces what is ready)."""
    deltas = [e for e in events if isinstance(e, TextDelta)]
    finished = events[-1]
    assert isinstance(finished, Finished)
    return (tuple(t for d in deltas for t in d.token_ids), "".join(d.text for d in deltas),
            tuple(lp for d in deltas for lp in d.logprobs), finished.finish_reason, finished.usage.completion_tokens)


@pytest.mark.parametrize("case", CASES)
async def test_a_replayed_stream_goes_on_as_the_uninterrupted_one_from_any_cut(case: str) -> None:
    kwargs = CASES[case]
    async with open_engine(str(tiny_model(LLAMA)), batch=1) as engine:
        events = [e async for e in engine.stream(engine.prepare("Once upon a time", **kwargs))]
        whole = _whole(events)
        chunks = [d.token_ids for d in events if isinstance(d, TextDelta) and d.token_ids]
        assert len(chunks) >= 4 and whole[-1] == kwargs["max_tokens"]
        for cut in (1, len(chunks) // 2, len(chunks) - 1):
            resumed = [e async for e in engine.stream(engine.prepare("Once upon a time", **kwargs),
                                                      replay=chunks[:cut])]
            replayed = [e.token_ids for e in resumed if isinstance(e, TextDelta)][:cut]
            assert replayed == chunks[:cut]  # the replayed chunks first, one delta each
            assert _whole(resumed)[:2] == whole[:2], f"cut after chunk {cut}"
            if case == "logprobs":  # the replayed tokens' logprobs are the client's already: the rest's follow
                after = len(whole[0]) - sum(map(len, chunks[:cut]))
                assert _whole(resumed)[2][-after:] == whole[2][-after:] and len(whole[2]) == len(whole[0])
            assert _whole(resumed)[3:] == whole[3:]
