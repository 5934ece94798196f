"""A served subprocess's output teed into a log file, noting the URL its "serving" line names."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path


def tee_output(process: subprocess.Popen[str], log: Path, serving: re.Pattern[str]) -> tuple[list[str], threading.Event, threading.Thread]:
    """Start copying `process`'s stdout into `log`; returns (url: filled from the first `serving` match,
    ready: set on that match or when the process ends, the copying thread)."""
    url: list[str] = []
    ready = threading.Event()

    def copy_output() -> None:
        assert process.stdout is not None
        with log.open("w", encoding="utf-8") as out:
            for line in process.stdout:
                out.write(line)
                out.flush()
                if not url and (match := serving.search(line)):
                    url.append(match.group(1))
                    ready.set()
        ready.set()  # the process ended: wake the waiter either way

    reader = threading.Thread(target=copy_output, name="served-output", daemon=True)
    reader.start()
    return url, ready, reader
