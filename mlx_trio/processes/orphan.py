"""`until_orphaned`: how the launcher's children (the engine's process, the fronts) notice it is gone.

Killed outright (SIGKILL, the OOM killer), the launcher can neither stop them
nor start them again; a child that outlived it would hold the port or the GPU
for nobody. Each watches its parent's pid and ends itself when it changes.
"""

from __future__ import annotations

import os

import trio

PARENT_CHECK_S = 0.5


async def until_orphaned(parent: int) -> None:
    """Return once this process's parent is no longer `parent` (it died; the process was re-parented)."""
    while os.getppid() == parent:
        await trio.sleep(PARENT_CHECK_S)
