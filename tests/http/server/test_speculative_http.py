"""The speculative surface over HTTP: `"speculative"` reaches the engine on every wire; /stats and /metrics report it."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_trio.errors import InvalidParameter
from mlx_trio.events import Finished, FinishReason, Usage
from mlx_trio.http.server.metrics import RequestLog
from mlx_trio.http.server.metrics import log as request_log
from mlx_trio.params import SamplingParams
from tests.http.fakes import FakeEngine
from tests.http.http_helpers import serve_fake

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}


@pytest.mark.parametrize("path", list(BODIES))
async def test_speculative_false_reaches_the_engine(path: str) -> None:
    engine = FakeEngine()
    async with serve_fake(engine) as (_, client):
        response = await client.post(path, json={**BODIES[path], "speculative": False})
        assert response.status_code == 200, response.text
        assert engine.prepared[-1][1]["speculative"] is False
        response = await client.post(path, json=BODIES[path])
        assert "speculative" not in engine.prepared[-1][1]  # the default: speculate when the engine does


def test_speculative_must_be_a_boolean() -> None:
    assert SamplingParams.from_kwargs({"speculative": False}).speculative is False
    assert SamplingParams().speculative is True
    with pytest.raises(InvalidParameter) as info:
        SamplingParams.from_kwargs({"speculative": "no"})
    assert info.value.field == "speculative"


class SpeculatingEngine(FakeEngine):
    def status(self) -> dict[str, Any]:
        status = super().status()
        status["counters"].update(decode_steps=40, decoded_tokens=100, speculative_proposed=80,
                                  speculative_accepted=60)
        return status


async def test_stats_and_metrics_report_speculation() -> None:
    async with serve_fake(SpeculatingEngine()) as (_, client):
        stats = (await client.get("/stats")).json()
        assert stats["speculative"] == {"proposed": 80, "accepted": 60, "acceptance": 0.75}
        assert stats["batch"]["decode_steps"] == 40 and stats["batch"]["decoded_tokens"] == 100
        text = (await client.get("/metrics")).text
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["mlx_trio_decode_steps_total"] == 40
    assert samples["mlx_trio_decoded_tokens_total"] == 100
    assert samples["mlx_trio_speculative_proposed_tokens_total"] == 80
    assert samples["mlx_trio_speculative_accepted_tokens_total"] == 60


def test_the_request_log_line_counts_accepted_proposals(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger=request_log.name)
    for rid, usage in (("spec", Usage(5, 9, speculative_proposed=8, speculative_accepted=6)), ("plain", Usage(5, 9))):
        log = RequestLog(rid, kind="chat", stream=False)
        log.saw(Finished(FinishReason.STOP, usage))
        log.done("stop")
    spec, plain = (r.getMessage() for r in caplog.records)
    assert "completion=9 accepted=6/8 ttft=" in spec
    assert "accepted=" not in plain


def test_the_speculative_flags_reach_the_engine_config() -> None:
    from mlx_trio.cli import build_parser, configs_from_args

    engine, _ = configs_from_args(build_parser().parse_args(
        ["serve", "--prompt-lookup", "--prompt-lookup-ngram", "5", "--num-draft-tokens", "4", "--draft-model", "d"]))
    assert (engine.prompt_lookup, engine.prompt_lookup_ngram, engine.num_draft_tokens, engine.draft_model) == (
        True, 5, 4, "d")
    plain, _ = configs_from_args(build_parser().parse_args(["serve"]))
    assert (plain.prompt_lookup, plain.prompt_lookup_ngram, plain.num_draft_tokens, plain.draft_model) == (
        False, 3, 3, None)
