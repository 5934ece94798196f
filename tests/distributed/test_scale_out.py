"""How a `serve` process takes its place in a group (mlx_trio/scale_out.py): refusals, flags, a lost group."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_trio import scale_out
from mlx_trio.cli import build_parser, configs_from_args
from mlx_trio.config import EngineConfig


def test_a_group_of_the_wrong_size_or_with_an_ssd_tier_is_refused() -> None:
    plain = EngineConfig()
    assert scale_out.refusal(2, 2, plain) is None
    assert scale_out.refusal(1, 3, plain) is None  # plain mlx.launch: its own rank count
    assert "started 3 ranks" in scale_out.refusal(2, 3, plain)
    assert "--prompt-cache-dir" in scale_out.refusal(1, 2, EngineConfig(prompt_cache_dir=Path("/tmp/x")))


@pytest.mark.parametrize(("flags", "named"), [
    (["--lora-modules", "a=/tmp/a"], "LoRA adapters"),
    (["--enable-lora-admin"], "LoRA adapters"),
    (["--draft-model", "/tmp/draft"], "--draft-model"),
    (["--kv-bits", "8"], "--kv-bits"),
])
def test_a_feature_not_run_in_lockstep_is_refused_at_start_across_ranks_only(flags: list[str], named: str) -> None:
    engine, _ = configs_from_args(build_parser().parse_args(["serve", *flags]))
    assert named in scale_out.refusal(1, 2, engine)
    assert scale_out.refusal(1, 1, engine) is None


def test_prompt_lookup_is_served_across_ranks() -> None:
    engine, _ = configs_from_args(build_parser().parse_args(["serve", "--prompt-lookup"]))
    assert scale_out.refusal(2, 2, engine) is None


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


def _solo_leader():
    """A Leader over MLX's group of one (its collectives return their input): the broadcast works."""
    import mlx.core as mx

    from mlx_trio.engine.distributed.leader import Leader
    from mlx_trio.engine.distributed.world import World

    return Leader(World(rank=0, size=2, backend="ring", host="h", group=mx.distributed.init()))


def _raise(exc: BaseException) -> None:
    raise exc


def test_a_job_that_fails_in_the_backend_loses_the_group_and_its_own_failure_does_not() -> None:
    from mlx_trio.engine.distributed.leader import GroupLost

    leader = _solo_leader()
    with pytest.raises(ValueError):
        leader.run_job(_raise, (ValueError("a bad request"),))
    assert leader.lost is None  # a job's own error: it failed on every rank alike
    with pytest.raises(RuntimeError):
        leader.run_job(_raise, (RuntimeError("[ring] connection to a peer was lost"),))
    assert leader.lost == "a follower was lost: [ring] connection to a peer was lost"
    with pytest.raises(GroupLost):  # the next collective on it might never return: nothing is sent
        leader.run_job(int, (1,))


def test_a_broadcast_that_fails_loses_the_group() -> None:
    from mlx_trio.engine.distributed.leader import Leader
    from mlx_trio.engine.distributed.world import World

    leader = Leader(World(rank=0, size=2, backend="ring", host="h", group=object()))  # not a group: it fails
    with pytest.raises(Exception):  # noqa: B017 - whatever MLX raises for it
        leader.run_job(int, (1,))
    assert leader.lost is not None and leader.jobs == 0


def test_pipeline_parallel_is_refused_for_a_model_without_pipeline_naming_those_with_it() -> None:
    import mlx.nn as nn

    from mlx_trio.engine.distributed.world import World, shard_model

    world = World(rank=0, size=2, backend="ring", host="h", group=object(), pipeline=True)
    with pytest.raises(ValueError, match=r"has no pipeline\(\) in mlx-lm; the model types that do: .*qwen2"):
        shard_model(nn.Linear(2, 2), world)


def test_tensor_and_pipeline_parallel_together_are_refused_before_any_rank_starts(capsys) -> None:
    from mlx_trio.cli import main

    assert main(["serve", "--tensor-parallel", "2", "--pipeline-parallel", "2"]) == 2
    assert "cannot be combined" in capsys.readouterr().err


def test_ranks_without_front_processes_or_with_a_refused_flag_are_refused_before_any_rank_starts(capsys) -> None:
    """A lost group ends rank 0's process: HTTP served there (--api-server-count 0) could not resume a stream."""
    from mlx_trio.cli import main

    assert main(["serve", "--tensor-parallel", "2", "--api-server-count", "0"]) == 2
    assert "--api-server-count 0" in capsys.readouterr().err
    assert main(["serve", "--tensor-parallel", "2", "--kv-bits", "8"]) == 2
    assert "--kv-bits is not supported across ranks" in capsys.readouterr().err


def test_heads_that_do_not_split_over_the_ranks_are_refused_naming_the_counts_that_would() -> None:
    from types import SimpleNamespace

    from mlx_trio.engine.distributed.world import check_heads_split

    smollm2 = SimpleNamespace(args=SimpleNamespace(num_attention_heads=9, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"9 attention heads and 3 KV heads.*over 2 ranks: --tensor-parallel 3 would"):
        check_heads_split(smollm2, 2)
    check_heads_split(smollm2, 3)  # splits
    check_heads_split(SimpleNamespace(args=SimpleNamespace(num_attention_heads=32, num_key_value_heads=8)), 4)
