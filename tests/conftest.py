"""Suite-wide settings: a hypothesis profile fit for a loaded 2-core CI box."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# CI machines are small and shared: time limits per example would make tests
# flaky without making them stronger, so speed is measured by benchmarks instead.
settings.register_profile(
    "mlx-trio",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=100,
)
settings.load_profile("mlx-trio")
