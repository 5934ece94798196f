"""A request body as a JSON object, and the typed reads of its fields every endpoint's parser uses.

Errors name the field (`InvalidParameter`, a 400) or the body itself
(`invalid_json` / `invalid_body`), in JSON's words for types.

JSON can write what Python cannot use: a number past float's range (`1e400`
parses to inf, `1` and 400 zeros to an int `float()` refuses) and a lone
surrogate escape (`"\\ud800"`, a str no tokenizer can encode). Both are
refused here, at parse time, naming where in the body they sit, so that no
field anywhere (sampling, tool arguments, a prompt) meets them later as an
`OverflowError` or a `UnicodeEncodeError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from mlx_trio.errors import InvalidParameter
from mlx_trio.http.server.errors import invalid_body, invalid_json
from mlx_trio.params import fits_a_float


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
    if _MAY_BE_UNFIT[isinstance(raw, str)].search(raw):
        for path, problem in _unfit_values(body, ""):
            raise InvalidParameter(path or "body", problem)
    return body


# What an unfit value needs in the text: 309+ digits in a row, a 3-digit exponent, a surrogate
# escape. Only a body that has one is walked (most have none), so the check costs one regex scan.
_HINT = r"\d{309}|[eE][+]?\d{3}|\\[uU][dD][89a-fA-F]"
_MAY_BE_UNFIT = {False: re.compile(_HINT.encode()), True: re.compile(_HINT)}


def _unfit_values(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, problem) for each number outside float's range and each str with a lone surrogate."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _unfit_values(key, path or "body")
            yield from _unfit_values(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _unfit_values(item, f"{path}[{i}]")
    elif isinstance(value, (int, float)) and not fits_a_float(value):
        yield path, "is a number outside the range of a 64-bit float"
    elif isinstance(value, str) and not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            yield path, f"holds a lone UTF-16 surrogate at character {exc.start} (not a Unicode character)"


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


def type_field(value: Any, where: str) -> str | None:
    """`value["type"]` when value is an object (None when it is not); a type that is not a string is a 400.

    Every wire API dispatches on `type` fields; a list or an object there must be a 400 naming the
    field, not a TypeError from a set or dict lookup (a 500).
    """
    kind = value.get("type") if isinstance(value, dict) else None
    if kind is not None and not isinstance(kind, str):
        raise InvalidParameter(f"{where}.type", f"must be a string, got {json_type(kind)}")
    return kind


def json_type(value: Any) -> str:
    names = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
             list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
