"""The front: the public HTTP server of `mlx-trio serve --tensor-parallel N`, which outlives the ranks.

It runs in the local launcher (mlx_trio/local_group.py), holds no MLX, and proxies every request to the
current generation's rank 0 on a loopback port; when the group is lost it keeps the clients' connections,
waits for the next generation and resumes their streams there (docs/scale-out.md "Recovery").
"""
