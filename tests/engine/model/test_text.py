"""TextStream: detokenized deltas and stop strings matched on text."""

from __future__ import annotations

from hypothesis import given, strategies as st

from mlx_trio.engine.model.text import TextStream


class CharDetokenizer:
    """A stand-in detokenizer whose token ids are code points (one char per token)."""

    def __init__(self) -> None:
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = chr(token)

    def finalize(self) -> None:
        self.last_segment = ""


def _run(text: str, stop: list[str]) -> tuple[str, bool, list[str]]:
    stream = TextStream(CharDetokenizer(), stop)
    pieces = []
    for ch in text:
        update = stream.add(ord(ch))
        pieces.append(update.text)
        if update.stopped:
            return "".join(pieces), True, pieces
    tail = stream.finish()
    pieces.append(tail.text)
    return "".join(pieces), False, pieces


def test_no_stop_strings_passes_text_through_at_once() -> None:
    """Without stop strings every token's text is released immediately."""
    out, stopped, pieces = _run("hello", [])
    assert (out, stopped) == ("hello", False)
    assert pieces[:5] == list("hello")


def test_stop_string_is_cut_and_never_shown() -> None:
    """The output ends right before the stop string, and no prefix of it leaks."""
    out, stopped, _ = _run("The answer is 42. END of it", ["END"])
    assert (out, stopped) == ("The answer is 42. ", True)


def test_partial_stop_prefix_is_released_when_it_does_not_complete() -> None:
    """Text held back as a possible stop prefix is released once it diverges, and at the end."""
    out, stopped, _ = _run("an ENigma EN", ["END"])
    assert (out, stopped) == ("an ENigma EN", False)


def test_earliest_of_several_stop_strings_wins() -> None:
    """With overlapping candidates the first occurrence in the text cuts."""
    out, stopped, _ = _run("abc STOP xyz HALT", ["HALT", "STOP"])
    assert (out, stopped) == ("abc ", True)


@given(st.text(alphabet="abcXY ", max_size=40), st.lists(st.text(alphabet="abcXY", min_size=1, max_size=4), max_size=3))
def test_matches_a_plain_find_on_the_whole_text(text: str, stop: list[str]) -> None:
    """Streaming stops at the first stop string to complete, cut where it (or an earlier hit) starts."""
    expected, hit = text, False
    for end in range(1, len(text) + 1):
        starts = [i for i in (text[:end].find(s) for s in stop) if i >= 0]
        if starts:
            expected, hit = text[: min(starts)], True
            break
    out, stopped, _ = _run(text, stop)
    assert out == expected
    assert stopped == hit


def test_the_matched_stop_string_is_named() -> None:
    """The update that stops names the stop string that matched first in the text (Anthropic's stop_sequence)."""
    stream = TextStream(CharDetokenizer(), ["zz", "b"])
    updates = [stream.add(ord(ch)) for ch in "abzz"[:2]]
    assert updates[-1].stopped and updates[-1].stop == "b" and updates[-1].text == ""
    assert not updates[0].stopped and updates[0].stop is None


def test_add_many_shows_what_add_shows_token_by_token() -> None:
    """A real BPE detokenizer (the tiny Llama's), text with multi-byte characters split across tokens:
    feeding a message's tokens at once gives the joined per-token text, chunk by chunk, and the same tail."""
    from mlx_lm.tokenizer_utils import load  # noqa: PLC0415  (tests may import mlx-lm)

    from mlx_trio.testing import LLAMA, tiny_model  # noqa: PLC0415

    tokenizer = load(tiny_model(LLAMA))
    ids = tokenizer.encode("Où est le café? Ünïcödé 🙂 spaces  and\nnew lines.", add_special_tokens=False)
    one, many = TextStream(tokenizer.detokenizer), TextStream(tokenizer.detokenizer)
    assert many.batches and not TextStream(tokenizer.detokenizer, ["x"]).batches
    for start in range(0, len(ids), 3):
        part = ids[start:start + 3]
        assert many.add_many(part) == "".join(one.add(t).text for t in part)
    assert many.finish() == one.finish()


def test_a_detokenizer_read_with_effects_goes_token_by_token() -> None:
    assert not TextStream(CharDetokenizer()).batches
