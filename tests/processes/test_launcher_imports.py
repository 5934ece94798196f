"""What `mlx-trio serve` imports before it starts the engine process delays the whole start (issue #46)."""

from __future__ import annotations

import subprocess
import sys


def test_the_launcher_imports_no_quart_before_starting_the_engine() -> None:
    """Quart (~0.15 s on a 2-core CPU) is the fronts' own: the launcher needs it only to drain, at the end."""
    code = ("import sys, mlx_trio.cli; from mlx_trio.processes.launcher import Launcher; "
            "print(sorted(m for m in ('quart', 'hypercorn', 'mlx', 'mlx_lm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
