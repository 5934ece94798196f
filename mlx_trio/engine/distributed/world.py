"""Which rank this process is in an mlx.distributed group, and the model shard a rank holds.

`mlx.launch` starts every rank with `MLX_RANK` (and, for the ring backend, `MLX_HOSTFILE`) in its
environment; `join_world` reads those through `mx.distributed.init`. A process started without
them is a world of one, and nothing in the engine changes (`World.size == 1`).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import attrs
import mlx.core as mx
import mlx.nn as nn

# The variable mlx.launch sets for every rank it starts (mlx/_distributed_utils/launch.py).
RANK_ENV = "MLX_RANK"


@attrs.frozen
class World:
    """This process's place in the group: rank 0 leads (actor tree, HTTP), ranks > 0 follow."""

    rank: int
    size: int
    backend: str
    host: str
    group: mx.distributed.Group | None = attrs.field(default=None, eq=False, repr=False)
    # How the model is split over the ranks: tensor parallel (`shard()`), or pipeline parallel
    # (`pipeline()`: each rank holds a run of layers).
    pipeline: bool = False

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0


SOLO = World(rank=0, size=1, backend="none", host=socket.gethostname())
_world: World = SOLO


def launched() -> bool:
    """Whether mlx.launch (or an equivalent launcher) started this process as one rank of a group."""
    return RANK_ENV in os.environ


def join_world(backend: str = "any", *, pipeline: bool = False) -> World:
    """Join the group mlx.launch set up (once per process, before any lease thread); SOLO if not launched.

    Raises:
      RuntimeError: launched, but the backend could not form the group.
    """
    global _world
    if not launched():
        return SOLO
    group = mx.distributed.init(strict=True, backend=backend)
    _world = World(rank=group.rank(), size=group.size(), backend=backend if backend != "any" else _backend_name(),
                   host=socket.gethostname(), group=group, pipeline=pipeline)
    return _world


def current_world() -> World:
    """The world `join_world` joined (SOLO before, or without a launcher)."""
    return _world


def shard_model(model: nn.Module, world: World) -> None:
    """Keep only this rank's shard of `model`'s (still lazy) weights: mlx-lm's `shard()` (tensor parallel),
    or its `pipeline()` (`world.pipeline`: this rank's run of layers; the others become None).

    Called between a lazy load and the weights' evaluation, so each rank reads and holds only its
    shard (mlx-lm's `sharded_load` does the same). The sharded layers sum their partial outputs
    across the group (`all_sum`), so every rank computes the same logits.

    Raises:
      ValueError: the model has no such sharding in mlx-lm (for pipeline: naming the model types that do),
        or its heads do not split evenly over the ranks (naming the rank counts that would).
    """
    if not world.distributed:
        return
    if world.pipeline:
        if not hasattr(getattr(model, "model", None), "pipeline"):
            raise ValueError(f"{type(model).__module__} has no pipeline() in mlx-lm; the model types that do: "
                             f"{', '.join(pipeline_model_types())}")
        model.model.pipeline(world.group)
        return
    if not hasattr(model, "shard"):
        raise ValueError(f"{type(model).__module__} has no tensor-parallel shard() in mlx-lm")
    check_heads_split(model, world.size)
    model.shard(world.group)


def check_heads_split(model: nn.Module, ranks: int) -> None:
    """Refuse a tensor-parallel split whose attention heads do not divide evenly over `ranks`.

    mlx-lm's `shard()` splits each projection's output rows over the ranks without checking: with
    SmolLM2-135M's 9 query and 3 KV heads on 2 ranks the shards hold 4.5 heads and the first
    attention fails with a shape error deep in the warm-up. Reads the model's `args`
    (`num_attention_heads`, `num_key_value_heads`); a model without them is left to `shard()`.

    Raises:
      ValueError: naming the heads and the rank counts that divide them.
    """
    args = getattr(model, "args", None)
    heads = [getattr(args, name, None) for name in ("num_attention_heads", "num_key_value_heads")]
    counts = [h for h in heads if isinstance(h, int) and h > 0]
    if not counts or all(h % ranks == 0 for h in counts):
        return
    fits = [n for n in range(2, max(counts) + 1) if all(h % n == 0 for h in counts)]
    advice = (f"--tensor-parallel {' or '.join(map(str, fits))} would" if fits
              else "no tensor-parallel rank count would; try --pipeline-parallel where the model type has it")
    raise ValueError(f"the model has {heads[0]} attention heads and {heads[1]} KV heads, which do not split "
                     f"evenly over {ranks} ranks: {advice}")


def pipeline_model_types() -> list[str]:
    """The mlx-lm model types whose model has `pipeline()` (its PipelineMixin), read from their source."""
    import mlx_lm.models

    root = Path(mlx_lm.models.__path__[0])
    return sorted(path.stem for path in root.glob("*.py")
                  if path.stem != "pipeline" and "PipelineMixin" in path.read_text(encoding="utf-8"))


def _backend_name() -> str:
    if "MLX_HOSTFILE" in os.environ:
        return "ring"
    if "MLX_JACCL_COORDINATOR" in os.environ:
        return "jaccl"
    if "NCCL_HOST_IP" in os.environ:
        return "nccl"
    return "mpi"
