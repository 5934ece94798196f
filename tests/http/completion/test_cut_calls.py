"""cut_calls: a cut call's name and arguments, and a JSON prefix's value as the Anthropic SDK reads it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_trio.http.completion.cut_calls import partial_json, read_cut_call

jiter = pytest.importorskip("jiter")  # the SDKs' partial JSON reader (a dependency of anthropic and openai)

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=4), st.booleans(), st.data())
def test_partial_json_reads_every_prefix_as_the_sdk_stream_reader(value: dict, compact: bool,
                                                                   data: st.DataObject) -> None:
    """A streamed cut tool_use and a whole one get the same `input`: jiter's `partial_mode=True` value."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":") if compact else None)
    cut = data.draw(st.integers(1, len(text)))
    assert partial_json(text[:cut]) == jiter.from_json(text[:cut].encode(), partial_mode=True)


@pytest.mark.parametrize(("text", "expected"), [
    ("", (None, "")),
    ('{"na', (None, "")),
    ('{"name":"get_', (None, "")),
    ('{"name":"get_w', ("get_weather", "")),
    ('{"name": "get_time", "arguments": {"a": [1, "x', ("get_time", '{"a": [1, "x')),
    ('{"name":"other","arguments":{', (None, "{")),
])
def test_read_cut_call_settles_the_name_by_the_callable_functions(text: str, expected: tuple) -> None:
    assert read_cut_call(text, ["get_weather", "get_time"]) == expected


def test_read_cut_call_refuses_what_is_no_call_object() -> None:
    assert read_cut_call("not json", ["f"]) is None
    assert read_cut_call('{"name":"f","arguments":[', ["f"]) is None
    assert read_cut_call("  ", ["f"]) == ("f", "")
