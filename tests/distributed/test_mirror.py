"""Jobs as bytes (engine/distributed/mirror.py): engine objects cross by key, callbacks become no-ops."""

from __future__ import annotations

import gc
import pickle
from functools import partial

import attrs
import pytest

from mlx_trio.engine.distributed.mirror import (Desynchronised, FollowerMirror, LeaderMirror, NotMirrored,
                                                ignored, keys_in)
from mlx_trio.engine.prompt_cache.ram_tier import CacheEntry


class Row:
    """Stands for an engine object (a SoloRow): state that lives on each rank."""

    __module__ = "mlx_trio.engine.batch.solo_row"  # where engine state lives: what the mirror keys

    def __init__(self, name: str) -> None:
        self.name, self.fed = name, 0

    def feed(self, n: int) -> int:
        self.fed += n
        return self.fed


@attrs.frozen
class Made:
    row: Row
    token: int


def made_row() -> Made:
    return Made(Row("a"), 7)


def a_row() -> Row:
    return Row("d")


class Actor:
    def report(self, tokens: list[int]) -> None:
        raise AssertionError("a follower must never call rank 0's actor")


def _ship(leader: LeaderMirror, follower: FollowerMirror, fn, *args):
    """One job: rank 0 runs it and keys its result; the follower runs the bytes and keys its own."""
    data = pickle.dumps((leader.next_key, leader.take_dropped(), leader.dumps((fn, args))))
    result = fn(*args)
    leader.add_result(result)
    next_key, dropped, payload = pickle.loads(data)
    follower.drop(dropped)
    follower.check(next_key)
    f_fn, f_args = follower.loads(payload)
    f_result = f_fn(*f_args)
    follower.add_result(f_result)
    return result, f_result


def test_an_object_a_job_returned_is_named_by_key_and_each_rank_uses_its_own() -> None:
    leader, follower = LeaderMirror(), FollowerMirror()
    made, f_made = _ship(leader, follower, made_row)
    assert f_made.row is not made.row and len(leader) == len(follower) == 1  # the record is walked, not keyed
    _ship(leader, follower, made.row.feed, 3)
    fed, f_fed = _ship(leader, follower, made.row.feed, 2)
    assert (fed, f_fed) == (5, 5) and f_made.row.fed == 5


def test_a_callback_into_rank_0_is_a_no_op_on_a_follower() -> None:
    leader, follower = LeaderMirror(), FollowerMirror()
    fn, args = follower.loads(leader.dumps((partial(Actor().report, [1]), ())))
    assert fn.func is ignored and fn() is None


def test_engine_state_without_a_key_is_refused() -> None:
    with pytest.raises(NotMirrored, match="Row"):
        LeaderMirror().dumps((Row.feed, (Row("b"), 1)))


def test_a_frozen_record_is_a_value_and_its_caches_are_keyed() -> None:
    entry = CacheEntry(tokens=(1, 2), caches=[Row("c0"), Row("c1")], nbytes=8, trimmable=True)
    keyed = list(keys_in((entry, [4, "x"], {"k": None})))
    assert [getattr(r, "name", None) for r in keyed] == ["c0", "c1", None]  # and its token-id array


def test_a_key_is_dropped_on_every_rank_when_rank_0_lets_its_object_go() -> None:
    leader, follower = LeaderMirror(), FollowerMirror()
    made, _ = _ship(leader, follower, a_row)
    del made
    gc.collect()
    _ship(leader, follower, int, 1)
    assert len(leader) == len(follower) == 0


def test_a_follower_that_made_other_keys_is_desynchronised() -> None:
    leader, follower = LeaderMirror(), FollowerMirror()
    leader.add_result(Row("e"))  # rank 0 got a row where the follower got nothing
    with pytest.raises(Desynchronised):
        follower.check(leader.next_key)
    with pytest.raises(Desynchronised):
        follower.object(0)
