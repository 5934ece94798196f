"""Tests of mlx_trio/profiling/."""
