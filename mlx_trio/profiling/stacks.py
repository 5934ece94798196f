"""Counting stack samples: which functions a thread was in (self) and under (cumulative).

A sample is a thread's current frame (`sys._current_frames()`). Its leaf
function gets a *self* count; every distinct function on the stack gets a
*cumulative* count (once per sample, however deep the recursion). Keys are
`qualname (file:line)` of the function's code object, cached per code
object so that a sample costs a walk and dictionary increments.
"""

from __future__ import annotations

import collections
import os
from types import CodeType
from typing import Any, Protocol


class Frame(Protocol):
    """What a sample needs of a frame: its code and its caller (real frames, or a test's fakes)."""

    @property
    def f_code(self) -> Any: ...

    @property
    def f_back(self) -> Frame | None: ...


_keys: dict[CodeType, str] = {}


def function_key(code: Any) -> str:
    """`qualname (file.py:first line)` for a code object."""
    key = _keys.get(code) if isinstance(code, CodeType) else None
    if key is None:
        name = getattr(code, "co_qualname", None) or code.co_name
        key = f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
        if isinstance(code, CodeType):
            _keys[code] = key
    return key


class StackCounts:
    """Self and cumulative sample counts of one thread (or of all threads of one name)."""

    def __init__(self) -> None:
        self.samples = 0
        self.self_counts: collections.Counter[str] = collections.Counter()
        self.cumulative: collections.Counter[str] = collections.Counter()

    def add(self, frame: Frame | None) -> None:
        """Count one sample whose innermost frame is `frame`."""
        if frame is None:
            return
        self.samples += 1
        self.self_counts[function_key(frame.f_code)] += 1
        seen: set[str] = set()
        while frame is not None:
            seen.add(function_key(frame.f_code))
            frame = frame.f_back
        self.cumulative.update(seen)

    def top(self, n: int) -> dict[str, Any]:
        """The `n` functions with most self and most cumulative samples, as JSON-ready data."""
        return {"samples": self.samples, "self": self.self_counts.most_common(n),
                "cumulative": self.cumulative.most_common(n)}
