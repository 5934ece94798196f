"""Plain-data views of children for `Supervisor.status`."""

from __future__ import annotations

from typing import Any

import attrs

from mlx_trio.supervision.child import Child, describe_error


def child_entry(child: Child, now: float) -> dict[str, Any]:
    """Return the parent's view of `child` as JSON-able data."""
    return {
        "id": child.spec.id,
        "kind": child.spec.kind,
        "restart": child.spec.restart.value,
        "state": child.state,
        "restarts": child.restarts,
        "last_error": child.last_error,
        "uptime_s": now - child.started_at if child.started_at is not None else None,
    }


def handle_stats(handle: object) -> dict[str, Any]:
    """Return ``{"stats": ..., "mailbox_depth": ...}`` from ``handle.statistics()``, if any.

    A ``statistics()`` that raises is reported as ``stats_error`` rather than raised,
    so one broken actor cannot take down the whole status tree.
    """
    statistics = getattr(handle, "statistics", None)
    if not callable(statistics):
        return {}
    try:
        stats = statistics()
    except Exception as exc:
        return {"stats_error": describe_error(exc)}
    if attrs.has(type(stats)):
        stats = attrs.asdict(stats)
    elif isinstance(stats, dict):
        stats = dict(stats)
    else:
        return {"stats": repr(stats)}
    entry: dict[str, Any] = {"stats": stats}
    if "mailbox_depth" in stats:
        entry["mailbox_depth"] = stats["mailbox_depth"]
    return entry
