"""A progress bar per run: rich if installed, else tqdm, else nothing.

Both are optional (the `bench` extra); the bench works without them. Bars go
to stderr so that the table on stdout stays clean for redirection.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol


class Bar(Protocol):
    def advance(self, ok: bool) -> None: ...


ProgressFactory = Callable[[str, int], AbstractContextManager[Bar]]


class _NullBar:
    def advance(self, ok: bool) -> None:
        return None


@contextmanager
def no_progress(label: str, total: int) -> Iterator[Bar]:
    """A bar that shows nothing (tests, pipes, `--no-progress`)."""
    yield _NullBar()


class _RichBar:
    def __init__(self, progress: Any, task: Any) -> None:
        self._progress, self._task, self._failed = progress, task, 0

    def advance(self, ok: bool) -> None:
        self._failed += 0 if ok else 1
        self._progress.update(self._task, advance=1, failed=self._failed)


@contextmanager
def _rich_progress(label: str, total: int) -> Iterator[Bar]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        yield _RichBar(progress, progress.add_task(label, total=total, failed=0))


class _TqdmBar:
    def __init__(self, bar: Any) -> None:
        self._bar, self._failed = bar, 0

    def advance(self, ok: bool) -> None:
        self._failed += 0 if ok else 1
        self._bar.set_postfix(failed=self._failed, refresh=False)
        self._bar.update(1)


@contextmanager
def _tqdm_progress(label: str, total: int) -> Iterator[Bar]:
    from tqdm import tqdm

    with tqdm(total=total, desc=label, file=sys.stderr, unit="req") as bar:
        yield _TqdmBar(bar)


class _CountingBar:
    def __init__(self) -> None:
        self.done, self.failed = 0, 0

    def advance(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1


@contextmanager
def line_progress(label: str, total: int) -> Iterator[Bar]:
    """One line on stderr when a run ends: for logs, where a live bar would be noise."""
    bar, start_s = _CountingBar(), time.perf_counter()
    try:
        yield bar
    finally:
        print(f"{label}: {bar.done}/{total} done, {bar.failed} failed, {time.perf_counter() - start_s:.1f} s",
              file=sys.stderr, flush=True)


def choose(enabled: bool = True) -> ProgressFactory:
    """rich, else tqdm, when stderr is a terminal; a line per run when it is not; nothing when not `enabled`."""
    if not enabled:
        return no_progress
    if not sys.stderr.isatty():
        return line_progress
    try:
        import rich.progress  # noqa: F401
        return _rich_progress
    except ImportError:
        pass
    try:
        import tqdm  # noqa: F401
        return _tqdm_progress
    except ImportError:
        return no_progress
