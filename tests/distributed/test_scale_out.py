"""How a `serve` process takes its place in a group (mlx_trio/scale_out.py): refusals, flags, a lost group."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_trio import scale_out
from mlx_trio.cli import build_parser, configs_from_args


def test_a_group_of_the_wrong_size_or_with_an_ssd_tier_is_refused() -> None:
    assert scale_out.refusal(2, 2, None) is None
    assert scale_out.refusal(1, 3, None) is None  # plain mlx.launch: its own rank count
    assert "started 3 ranks" in scale_out.refusal(2, 3, None)
    assert "--prompt-cache-dir" in scale_out.refusal(1, 2, Path("/tmp/x"))


def test_the_scale_out_flags_reach_the_config() -> None:
    args = build_parser().parse_args(["serve", "--tensor-parallel", "2", "--collective-timeout", "3.5"])
    engine, _ = configs_from_args(args)
    assert args.tensor_parallel == 2 and engine.collective_timeout_s == 3.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tensor-parallel", "0"])


def test_once_the_group_is_lost_every_job_fails_at_once_and_runs_nowhere() -> None:
    from mlx_trio.engine.distributed.leader import GroupLost, Leader
    from mlx_trio.engine.distributed.world import World

    leader = Leader(World(rank=0, size=2, backend="ring", host="h", group=object()))  # never reached
    leader.lost = "a follower was lost"
    ran: list[int] = []
    with pytest.raises(GroupLost, match="a follower was lost"):
        leader.run_job(ran.append, (1,))
    assert ran == [] and leader.jobs == 0
