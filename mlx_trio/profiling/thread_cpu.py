"""Per-thread CPU time from Linux's `/proc/PID/task/TID/stat`, read from inside or outside the process.

`utime` and `stime` (fields 14 and 15, in clock ticks) of each task are the
thread's user and system CPU. `comm` is the kernel's thread name (15
characters; Python threads are not named there before 3.14, so a process
reading itself names its threads through `threading` instead). Where there is
no `/proc` (macOS), every reader returns nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 0.01


@attrs.frozen
class TaskCpu:
    """One thread's CPU seconds so far, and its kernel name."""

    tid: int
    comm: str
    cpu_s: float


def parse_stat(text: str, tick_s: float = _TICK_S) -> TaskCpu:
    """Parse one `stat` line. `comm` may hold spaces and parentheses: it ends at the last ')'.

    Raises:
      ValueError: the line is not a stat line.
    """
    head, close, tail = text.rpartition(")")
    tid_text, open_paren, comm = head.partition(" (")
    if not close or not open_paren:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}")
    fields = tail.split()  # fields[0] is field 3 (state): utime is field 14, stime 15
    return TaskCpu(int(tid_text), comm, (int(fields[11]) + int(fields[12])) * tick_s)


def process_cpu_s(pid: int | str = "self", proc: Path = Path("/proc")) -> float | None:
    """The whole process's CPU seconds (live and exited threads), or None without `/proc`."""
    try:
        return parse_stat((proc / str(pid) / "stat").read_text()).cpu_s
    except (OSError, ValueError, IndexError):
        return None


def tasks(pid: int | str = "self", proc: Path = Path("/proc")) -> dict[int, TaskCpu]:
    """Every live thread of `pid` by tid; empty without `/proc`. A thread that exits meanwhile is skipped."""
    out: dict[int, TaskCpu] = {}
    try:
        entries = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return out
    for entry in entries:
        try:
            task = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
        out[task.tid] = task
    return out


def cpu_by_name(start: Mapping[int, TaskCpu], end: Mapping[int, TaskCpu],
                names: Mapping[int, str] | None = None) -> dict[str, dict[str, float]]:
    """CPU seconds spent between two `tasks` snapshots, summed per thread name.

    A thread's name is `names[tid]` (Python's names, for a process reading
    itself) or else its `comm`. A thread born after `start` counts from zero;
    one gone by `end` is lost (its time is still in `process_cpu_s`).
    Returns {name: {"cpu_s": seconds, "threads": how many tids}}.
    """
    names = names or {}
    out: dict[str, dict[str, float]] = {}
    for tid, task in end.items():
        before = start[tid].cpu_s if tid in start else 0.0
        entry = out.setdefault(names.get(tid, task.comm), {"cpu_s": 0.0, "threads": 0})
        entry["cpu_s"] += max(0.0, task.cpu_s - before)
        entry["threads"] += 1
    return out


def top_threads(usage: Mapping[str, Mapping[str, float]], names: Iterable[str] = ()) -> list[tuple[str, float]]:
    """(name, cpu_s) of `usage`, busiest first; `names` first of all, in their order, where present."""
    first = [(name, usage[name]["cpu_s"]) for name in names if name in usage]
    rest = sorted(((n, u["cpu_s"]) for n, u in usage.items() if n not in dict(first)), key=lambda x: -x[1])
    return first + rest


def process_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """`pid` and every live descendant (`serve --api-server-count N`: the launcher, the engine's process, the
    fronts), parents first; just `[pid]` without `/proc`."""
    children: dict[int, list[int]] = {}
    for entry in proc.glob("[0-9]*"):
        try:
            text = (entry / "stat").read_text()
            ppid = int(text[text.rindex(")") + 2:].split()[1])  # field 4, after the state
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        out.append(current)
        todo.extend(sorted(children.get(current, [])))
    return out
