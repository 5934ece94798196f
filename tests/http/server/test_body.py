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
