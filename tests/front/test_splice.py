"""`Splice` (mlx_trio/front/splice.py): what of rank 0's linked stream the client may see, across attempts."""

from __future__ import annotations

from mlx_trio.front.protocol import LOST, commit
from mlx_trio.front.splice import Splice

OPENING = b"event: message_start\ndata: {}\n\n"
A = b"data: {\"a\": 1}\n\n"
B = b"data: {\"b\": 2}\n\n"


def test_a_chunk_goes_out_only_once_its_commit_arrived_and_the_commit_never() -> None:
    splice = Splice()
    assert splice.feed(OPENING) == b""
    assert splice.feed(commit(())) == OPENING and splice.opened and splice.groups == []
    assert splice.feed(A + commit((5, 6))[:4]) == b""  # the commit itself is cut in two
    assert splice.feed(commit((5, 6))[4:]) == A
    assert splice.groups == [[5, 6]] and splice.delivered == 2


def test_an_event_cut_in_the_middle_is_dropped_at_the_cut_and_the_next_attempt_carries_on() -> None:
    splice = Splice()
    out = splice.feed(OPENING + commit(()) + A + commit((5,)) + B[:7])
    assert out == OPENING + A
    splice.restart()  # rank 0 died: B's first bytes never reach the client
    assert splice.feed(B + commit((6, 7))) == B
    assert splice.groups == [[5], [6, 7]]
    assert splice.end() == b""


def test_lost_drops_what_is_uncommitted_and_ignores_the_rest() -> None:
    splice = Splice()
    out = splice.feed(OPENING + commit(()) + A + LOST + b"data: {\"error\": {}}\n\ndata: [DONE]\n\n")
    assert out == OPENING and splice.lost and splice.groups == []
    assert splice.feed(B + commit((9,))) == b""
    splice.restart()
    assert not splice.lost and splice.feed(A + commit((5,))) == A


def test_the_clean_end_of_an_answer_is_its_last_commit() -> None:
    """The last chunk (the finish, [DONE]) carries no commit: the body's end is its commit."""
    splice = Splice()
    assert splice.feed(A + commit((1,)) + B + b"data: [DONE]\n\n") == A
    assert splice.end() == B + b"data: [DONE]\n\n"
