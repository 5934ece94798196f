"""The fast SSE encoder (`sse.dumps`, orjson) and the prebuilt chunk templates: the same content as `json`.

`dumps` must parse to exactly what `json.dumps` of the same payload parses to,
with the same bytes wherever no float is involved (strings, ints, nesting,
key order), and a `StringTemplate` must give the very bytes `event` gives.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_trio.http.completion.output_router import Content, Reasoning
from mlx_trio.http.openai.objects import ResponseShape
from mlx_trio.http.server import sse
from mlx_trio.http.server.sse import SLOT, StringTemplate, dumps, event

TRICKY = ["", "plain", 'quote " and \\ backslash', "tab\tnew\nline\rcr\x00nul\x1f\x7f", "é ü 中文 🙂",
          "a\u0085b\u2028c\u2029d", "</script>/slash", "\ud7ff\ue000x"]


def _json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).translate(
        {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}).encode()


def test_orjson_is_the_encoder_here() -> None:
    """The dependency is installed, so the tests below compare orjson with json (not json with itself)."""
    assert sse.orjson is not None


# Text without lone surrogates (neither encoder can write those as UTF-8).
texts = st.text(st.characters(blacklist_categories=("Cs",)))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=12)


@given(json_values)
def test_dumps_writes_the_same_bytes_as_json_without_floats(value: object) -> None:
    assert dumps(value) == _json(value)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=6))
def test_dumps_floats_parse_to_the_same_values(values: list[float]) -> None:
    """Floats may be spelled differently (1e-05 against 1e-5) but read back the same."""
    assert json.loads(dumps({"logprobs": values})) == json.loads(_json({"logprobs": values}))


def test_an_int_over_64_bits_falls_back_to_json() -> None:
    assert dumps({"n": 2**70}) == _json({"n": 2**70})


@pytest.mark.parametrize("text", TRICKY)
def test_dumps_escapes_what_splitlines_breaks_on(text: str) -> None:
    data = dumps({"t": text})
    assert data == _json({"t": text}) and data.decode().splitlines() == [data.decode()]


@pytest.mark.parametrize("kind", [Content, Reasoning])
@pytest.mark.parametrize("text", TRICKY)
def test_a_chat_chunk_template_gives_the_bytes_event_gives(kind: type, text: str) -> None:
    shape = ResponseShape.new(chat=True, model="tiny-model")
    template = StringTemplate(shape.piece_chunks(kind(SLOT))[0])
    assert template.fill(text) == event(shape.piece_chunks(kind(text))[0])


@given(texts)
def test_a_named_template_gives_the_bytes_event_gives(text: str) -> None:
    payload = {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": SLOT}}
    filled = {**payload, "delta": {"type": "text_delta", "text": text}}
    assert StringTemplate(payload, name="content_block_delta").fill(text) == event(filled, name="content_block_delta")


def test_a_template_needs_its_slot_exactly_once() -> None:
    with pytest.raises(ValueError):
        StringTemplate({"a": "no slot"})
    with pytest.raises(ValueError):
        StringTemplate({"a": SLOT, "b": SLOT})


@pytest.mark.parametrize("text", TRICKY)
def test_without_orjson_the_fallback_writes_the_same_bytes(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = {"id": "x", "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None}], "n": 3}
    fast = dumps(payload)
    monkeypatch.setattr(sse, "orjson", None)
    assert dumps(payload) == fast == _json(payload)
