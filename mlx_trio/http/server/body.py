"""A request body as a JSON object, and the typed reads of its fields every endpoint's parser uses.

Errors name the field (`InvalidParameter`, a 400) or the body itself
(`invalid_json` / `invalid_body`), in JSON's words for types.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.server.errors import invalid_body, invalid_json


def decode_json_object(raw: bytes | str) -> dict[str, Any]:
    """Parse a request body; anything but a JSON object is a 400 naming the problem."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise invalid_json("nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise invalid_json(f"not UTF-8 ({exc.reason})") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers over Python's digit limit
        raise invalid_json(str(exc)) from None
    if not isinstance(body, dict):
        raise invalid_body(json_type(body))
    return body


def optional_field(body: Mapping[str, Any], name: str, kind: type, *, field: str | None = None) -> Any:
    """`body[name]` if present and of `kind` (str, bool, int or dict), None if absent or null."""
    value = body.get(name)
    if value is None:
        return None
    ok = is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise InvalidParameter(field or name, f"must be {_KIND_NAMES[kind]}, got {json_type(value)}")
    return value


_KIND_NAMES = {str: "a string", bool: "a boolean", int: "an integer", dict: "an object"}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_type(value: Any) -> str:
    names = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
             list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
