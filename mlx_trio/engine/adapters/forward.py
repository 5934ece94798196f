"""Forwards with per-row adapters: which slot each row of a forward uses, set around the model call.

The batch code (engine/batch/) holds rows' `AdapterUse`s and builds each
forward through `rows_selected(uses).applied()`; a row alone is given
`adapted(model, ...)`, a callable like the model. Rows without an adapter
(or a server without any) get the model itself: no wrapper, nothing set.
Lease thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import attrs
import mlx.nn as nn

from mlx_trio.engine.adapters.resident import AdapterUse
from mlx_trio.engine.adapters.row_lora import PerRow, RowSelection, selected


@attrs.frozen
class Selected:
    """The selection to set while building a forward of some rows (both None: every row is a base row)."""

    selection: RowSelection | None = None
    choice: int | PerRow | None = None

    def applied(self) -> AbstractContextManager[None]:
        return selected(self.selection, self.choice)


BASE_ROWS = Selected()


def rows_selected(uses: Sequence[AdapterUse | None]) -> Selected:
    """What a forward of rows holding `uses` (batch order; None for a base row) sets."""
    owner = next((use.owner for use in uses if use is not None), None)
    if owner is None:
        return BASE_ROWS
    return Selected(owner.selection, owner.choice(uses))


class AdaptedModel:
    """`model` called with one row's adapter selected."""

    def __init__(self, model: nn.Module, selection: Selected) -> None:
        self._model = model
        self._selection = selection

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._selection.applied():
            return self._model(*args, **kwargs)


def adapted(model: nn.Module, use: AdapterUse | None) -> nn.Module | AdaptedModel:
    """The forward of a row holding `use`: the model itself for a base row."""
    return model if use is None else AdaptedModel(model, rows_selected([use]))


def release_all(uses: Sequence[AdapterUse | None]) -> None:
    for use in uses:
        if use is not None:
            use.release()


