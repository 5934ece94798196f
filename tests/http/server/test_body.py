"""Request bodies as JSON objects (`http/server/body.py`) on their own."""

from __future__ import annotations

import pytest

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.server.body import decode_json_object, optional_field
from mlx_trio.http.server.errors import HttpError


@pytest.mark.parametrize("raw", [b'{"a": 1}', '{"a": 1}'])
def test_decode_accepts_bytes_and_text(raw: bytes | str) -> None:
    """The body decodes from bytes or str."""
    assert decode_json_object(raw) == {"a": 1}


def test_decode_rejects_non_objects_with_an_http_error() -> None:
    """A JSON array is an HttpError 400 invalid_body."""
    with pytest.raises(HttpError) as info:
        decode_json_object(b"[]")
    assert info.value.error.status == 400 and info.value.error.code == "invalid_body"


@pytest.mark.parametrize(("value", "kind", "says"), [("3", int, "must be an integer, got string"),
                                                     (True, int, "must be an integer, got boolean"),
                                                     (1, bool, "must be a boolean, got integer"),
                                                     ([], dict, "must be an object, got array")])
def test_optional_field_names_the_json_type(value: object, kind: type, says: str) -> None:
    """A field of the wrong JSON type is refused naming the field and, in JSON's words, what came."""
    with pytest.raises(InvalidParameter) as info:
        optional_field({"f": value}, "f", kind, field="outer.f")
    assert info.value.field == "outer.f" and str(info.value) == f"outer.f: {says}"
    assert optional_field({"f": None}, "f", kind) is None and optional_field({}, "f", kind) is None


@pytest.mark.parametrize(("raw", "field"), [(b'{"a": 1e400}', "a"), (b'{"a": {"b": [0, -1e999]}}', "a.b[1]"),
                                            (b'{"t": 1' + b"0" * 400 + b"}", "t"),
                                            (b'{"m": [{"c": "x\\udc00"}]}', "m[0].c"),
                                            ('{"\\ud800": 1}', "body")])
def test_decode_refuses_what_json_writes_but_python_cannot_use(raw: bytes | str, field: str) -> None:
    """A number past float's range or a lone surrogate is an InvalidParameter naming where it sits."""
    with pytest.raises(InvalidParameter) as info:
        decode_json_object(raw)
    assert info.value.field == field


def test_decode_keeps_what_only_looks_unfit() -> None:
    """Large but finite numbers, an escaped backslash before "ud800", a surrogate pair: all kept."""
    raw = b'{"a": 1.5e308, "b": "\\\\ud800", "c": "\\ud83d\\ude00", "d": ' + b"9" * 308 + b"}"
    assert decode_json_object(raw) == {"a": 1.5e308, "b": "\\ud800", "c": "\U0001f600", "d": int("9" * 308)}
