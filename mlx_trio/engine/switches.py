"""Environment switches: the variables that turn one mechanism off (or back to an older way), read in one way."""

from __future__ import annotations

import os

# What a switch variable is set to when it is on.
ON = ("1", "true", "yes")


def switched_on(name: str) -> bool:
    """Whether the environment variable `name` is set to 1, true or yes."""
    return os.environ.get(name, "") in ON
