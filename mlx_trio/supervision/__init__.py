"""OTP-style supervision on Trio: child specs, restart types, strategies and supervisors.

Never imports MLX: supervision is plain Trio and can be tested without a model.
"""

from mlx_trio.supervision.errors import SupervisorGaveUp
from mlx_trio.supervision.restart import Backoff
from mlx_trio.supervision.retry import Down, Retrying
from mlx_trio.supervision.spec import ChildSpec, Restart, Strategy
from mlx_trio.supervision.supervisor import Supervisor

__all__ = ["Backoff", "ChildSpec", "Down", "Restart", "Retrying", "Strategy", "Supervisor", "SupervisorGaveUp"]
