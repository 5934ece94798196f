"""SamplingParams: coercion and validation name the offending field."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from mlx_trio.errors import InvalidParameter
from mlx_trio.params import Constraint, SamplingParams

VOCAB = 100


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": VOCAB}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"repetition_context_size": 0}, "repetition_context_size"),
        ({"stop": 5}, "stop"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": True}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"constraint": {"type": "object"}}, "constraint"),
        ({"constraint": Constraint("regex", "a+")}, "constraint"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "big"}}, "logit_bias"),
        ({"logit_bias": {VOCAB + 1: 1.0}}, "logit_bias"),
        ({"seed": "seven"}, "seed"),
        ({"temprature": 0.5}, "temprature"),
        ({"temperature": 10**400}, "temperature"),
        ({"presence_penalty": -(10**400)}, "presence_penalty"),
        ({"logit_bias": {"3": 10**400}}, "logit_bias"),
    ],
)
def test_bad_values_raise_invalid_parameter_naming_the_field(kwargs: dict, field: str) -> None:
    """Each bad value raises InvalidParameter whose field is the key the caller sent."""
    with pytest.raises(InvalidParameter) as info:
        SamplingParams.from_kwargs(kwargs).validate(vocab_size=VOCAB)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_loose_inputs_are_normalised() -> None:
    """A string stop becomes a tuple; logit_bias keys may be numeric strings."""
    params = SamplingParams.from_kwargs({"stop": "END", "logit_bias": {"7": 2}, "temperature": 1}).validate(vocab_size=VOCAB)
    assert params.stop == ("END",)
    assert params.logit_bias == ((7, 2.0),)
    assert params.temperature == 1.0 and not params.is_greedy


@given(st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed",
                                        "logit_bias", "presence_penalty"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                                 st.lists(st.text(max_size=3), max_size=3),
                                 st.dictionaries(st.text(max_size=3), st.floats(), max_size=2))))
def test_any_input_is_accepted_or_rejected_with_invalid_parameter(kwargs: dict) -> None:
    """Arbitrary junk never raises anything but InvalidParameter."""
    try:
        SamplingParams.from_kwargs(kwargs).validate(vocab_size=VOCAB)
    except InvalidParameter:
        pass


def test_constraint_passes_through_and_must_be_a_constraint() -> None:
    """A Constraint (for the grammar engine) is kept as given; anything else is refused naming the field."""
    from mlx_trio.params import Constraint  # noqa: PLC0415

    constraint = Constraint("lark", "start: \"x\"")
    assert SamplingParams.from_kwargs({"constraint": constraint}).constraint == constraint
    assert SamplingParams().constraint is None
    with pytest.raises(InvalidParameter) as info:
        SamplingParams.from_kwargs({"constraint": "start: x"})
    assert info.value.field == "constraint"


def test_logprobs_and_constraint_fields() -> None:
    """top_logprobs alone implies logprobs; a Constraint passes through unchanged."""
    constraint = Constraint("lark", 'start: "a"\n')
    params = SamplingParams.from_kwargs({"top_logprobs": 3, "constraint": constraint}).validate(vocab_size=VOCAB)
    assert params.wants_logprobs and params.constraint == constraint
    assert not SamplingParams().wants_logprobs and SamplingParams(logprobs=True).wants_logprobs
