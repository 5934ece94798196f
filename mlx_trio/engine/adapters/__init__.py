"""LoRA and DoRA adapters served per row: read from mlx-lm's adapter directories, applied inside the batched forward."""
