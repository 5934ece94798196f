"""Checks of Responses objects and events against the `openai` SDK's typed models (the API reference's shapes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic
from openai.types.responses import Response, ResponseStreamEvent

_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def valid_response(payload: dict[str, Any]) -> Response:
    return Response.model_validate(payload)


def valid_events(events: Sequence[dict[str, Any]]) -> list[Any]:
    """Each event parses as the SDK's model of its type, and sequence numbers count up from 0 without gaps."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    parsed = [_EVENT.validate_python(e) for e in events]
    for event, model in zip(events, parsed):
        assert model.type == event["type"]  # not swallowed by a looser member of the union
        assert type(model).__name__ != "dict"
    return parsed
