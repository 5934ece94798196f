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


_RANK = r"""
import json, os, signal, sys, time
from pathlib import Path
rank, marks = int(os.environ["MLX_RANK"]), Path(sys.argv[1])
first = not (marks / "started").exists()
if rank == 0:
    (marks / "started").touch()
    (marks / f"rank0-{int(first)}.json").write_text(json.dumps([sys.argv[2:], os.environ.get("MLX_TRIO_FRONT_SECRET")]))
    if not first:
        sys.exit(0)  # the second generation stops for good
    signal.signal(signal.SIGUSR1, lambda *_: sys.exit(3))  # told its follower died: exit (any code)
    time.sleep(60)
    sys.exit(4)
sys.exit(1 if first else 0)  # the first generation's follower dies at once
"""


def test_a_follower_that_dies_is_told_to_rank_0_and_the_ranks_are_launched_again(tmp_path: Path) -> None:
    """mlx_trio/local_group.py with stand-in ranks: generation 1's follower exits; the launcher signals
    rank 0 (which exits), launches both again; generation 2's rank 0 exits 0, which ends the command."""
    import sys

    from mlx_trio.local_group import LocalGroup

    group = LocalGroup(2, [str(tmp_path)], program=[sys.executable, "-c", _RANK])
    assert group.run() == 0
    assert group.generation == 2


def test_with_a_front_each_generations_rank_0_serves_on_a_loopback_port_of_its_own_and_the_front_hears_why() -> None:
    """The same stand-in ranks behind a front's `GroupState`: each rank 0 gets `--host 127.0.0.1 --port P`
    after the user's flags and the launch's secret; the front hears each launch and the loss, with its reason."""
    import json
    import sys
    import tempfile
    from pathlib import Path

    from mlx_trio.front.group_state import GroupState
    from mlx_trio.local_group import LocalGroup

    calls: list[tuple[object, ...]] = []

    class Recorded(GroupState):
        def launched(self, number: int, port: int, reason: str) -> None:
            calls.append(("launched", number, port, reason))
            super().launched(number, port, reason)

        def lost(self, reason: str) -> None:
            calls.append(("lost", reason))
            super().lost(reason)

    with tempfile.TemporaryDirectory() as marks:
        group = LocalGroup(2, [marks, "--port", "8000"], program=[sys.executable, "-c", _RANK], front=Recorded(),
                           secret="s")
        assert group.run() == 0
        first, second = (json.loads((Path(marks) / f"rank0-{n}.json").read_text()) for n in (1, 0))
    ports = [c[2] for c in calls if c[0] == "launched"]
    assert first == [["--port", "8000", "--host", "127.0.0.1", "--port", str(ports[0])], "s"]
    assert second[0][-1] == str(ports[1]) and ports[0] != ports[1]
    # The stand-in follower exits 1, or 0 when it starts after rank 0 marked the first launch: either way it died.
    died = "rank 1 exited (exit code 1)" if "exit code 1" in str(calls[1]) else "rank 1 exited (exit code 0)"
    assert calls == [("launched", 1, ports[0], "starting: the ranks are loading the model"),
                     ("lost", f"the scale-out group was lost: {died}"),
                     ("lost", f"the scale-out group is being relaunched: {died}"),
                     ("launched", 2, ports[1], f"the scale-out group is being relaunched: {died}")]


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


def test_heads_that_do_not_split_over_the_ranks_are_refused_naming_the_counts_that_would() -> None:
    from types import SimpleNamespace

    from mlx_trio.engine.distributed.world import check_heads_split

    smollm2 = SimpleNamespace(args=SimpleNamespace(num_attention_heads=9, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"9 attention heads and 3 KV heads.*over 2 ranks: --tensor-parallel 3 would"):
        check_heads_split(smollm2, 2)
    check_heads_split(smollm2, 3)  # splits
    check_heads_split(SimpleNamespace(args=SimpleNamespace(num_attention_heads=32, num_key_value_heads=8)), 4)
