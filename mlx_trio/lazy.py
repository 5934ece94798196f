"""Names a package hands out lazily (PEP 562), so importing it loads nothing heavy until a name is used.

`import mlx_trio.errors` must not load MLX, and `mlx-trio serve` reads its flags and checks its
port before quart and hypercorn load: each package lists its public names and the module that
defines each, and imports that module on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package`: each name of `exports` from its module, on first use."""
    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
