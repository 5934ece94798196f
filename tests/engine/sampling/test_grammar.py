"""engine/sampling/grammar.py: what a constraint compiles to, what it refuses, and one row's mask."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from mlx_trio.engine.sampling.grammar import GrammarMatcher, build_grammar_tokenizer, compile_constraint
from mlx_trio.errors import InvalidParameter
from mlx_trio.params import Constraint
from mlx_trio.testing.tiny_models import LLAMA, tiny_model


@cache
def _tokenizers() -> tuple[Any, Any]:
    """The tiny model's mlx-lm tokenizer and llguidance's view of it."""
    _, tokenizer = load(str(tiny_model(LLAMA)))
    return tokenizer, build_grammar_tokenizer(tokenizer, tokenizer.eos_token_ids)


def _schema(schema: Any) -> Constraint:
    return Constraint("json_schema", json.dumps(schema))


@pytest.mark.parametrize(("constraint", "says"), [
    (_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "uniqueItems"),
    (_schema({"not": {"type": "string"}}), "not"),
    (_schema({"type": "object", "propertyNames": {"maxLength": 3}}), "propertyNames"),
    (_schema({"if": {"type": "string"}, "then": {"minLength": 1}}), "if"),
    (_schema({"type": "strnig"}), "strnig"),
    (_schema({"type": "string", "format": "no-such-format"}), "no-such-format"),
    (_schema({"type": "string", "pattern": "[a-"}), "unclosed"),
    (_schema({"$ref": "#/$defs/missing"}), "missing"),
    (_schema({"type": "array", "minItems": 3, "maxItems": 1}), "minItems"),
    (Constraint("json_schema", '{"type": "object"'), "not valid JSON"),
    (Constraint("json_schema", "[1, 2]"), "must be an object"),
    (Constraint("lark", 'start: "a" | b\n'), "unknown name"),
])
def test_unenforceable_constraints_are_invalid_parameters(constraint: Constraint, says: str) -> None:
    """Unsupported keywords, invalid schemas and broken grammars are refused naming "constraint", never ignored."""
    _, grammar_tokenizer = _tokenizers()
    with pytest.raises(InvalidParameter) as info:
        compile_constraint(constraint, grammar_tokenizer)
    assert info.value.field == "constraint"
    assert says in info.value.message


def test_the_mask_allows_exactly_what_the_grammar_allows() -> None:
    """For `"yes" | "no"` the first mask allows tokens that start one of them, and EOS once complete."""
    tokenizer, grammar_tokenizer = _tokenizers()
    constraint = Constraint("lark", 'start: "yes" | "no"\n')
    matcher = GrammarMatcher(grammar_tokenizer, compile_constraint(constraint, grammar_tokenizer))
    allowed = np.array(matcher.allowed(512))
    texts = {tokenizer.decode([int(t)]) for t in np.nonzero(allowed)[0]}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    matcher.consume(tokenizer.encode("no"))
    assert matcher.is_stopped
    assert np.nonzero(np.array(matcher.allowed(512)))[0].tolist() == sorted(tokenizer.eos_token_ids)


def test_masked_logits_are_minus_infinity_outside_the_grammar() -> None:
    """`apply` keeps allowed logits unchanged and sets the rest to -inf; a wider vocabulary is masked too."""
    _, grammar_tokenizer = _tokenizers()
    matcher = GrammarMatcher(grammar_tokenizer, compile_constraint(_schema({"type": "object"}), grammar_tokenizer))
    logits = mx.arange(520, dtype=mx.float32)[None]
    masked = np.array(matcher.apply(logits))[0]
    allowed = np.array(matcher.allowed(520))
    assert allowed[512:].sum() == 0 and allowed.sum() >= 1
    assert (masked[allowed] == np.arange(520)[allowed]).all()
    assert np.isneginf(masked[~allowed]).all()


def test_a_resumed_matcher_continues_where_the_request_stood() -> None:
    """`for_row` with the tokens generated before a resume gives the same mask as consuming them one by one."""
    tokenizer, grammar_tokenizer = _tokenizers()
    constraint = _schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    done = tokenizer.encode('{"a":')
    resumed = GrammarMatcher.for_row(constraint, grammar_tokenizer, done)
    fresh = GrammarMatcher.for_row(constraint, grammar_tokenizer)
    assert resumed is not None and fresh is not None
    for token in done:
        fresh.consume((token,))
    assert np.array_equal(np.array(resumed.allowed(512)), np.array(fresh.allowed(512)))
    assert GrammarMatcher.for_row(None, grammar_tokenizer) is None


def test_a_bad_labelled_schema_is_named_by_its_field_and_the_grammar_is_not_shown() -> None:
    """A lark grammar built from labelled schemas that fails names the first bad schema's field, not the grammar."""
    _, grammar_tokenizer = _tokenizers()
    good, bad = {"type": "object"}, {"type": "array", "uniqueItems": True}
    source = f"%llguidance {{}}\nstart: a | b\na: %json {json.dumps(good)}\nb: %json {json.dumps(bad)}\n"
    constraint = Constraint("lark", source, schemas=(("tools[0].function.parameters", json.dumps(good)),
                                                     ("tools[1].function.parameters", json.dumps(bad))))
    with pytest.raises(InvalidParameter) as info:
        compile_constraint(constraint, grammar_tokenizer)
    assert info.value.field == "tools[1].function.parameters"
    assert "uniqueItems" in info.value.message and "%json" not in info.value.message
    unlabelled = Constraint("lark", source)
    with pytest.raises(InvalidParameter) as info:
        compile_constraint(unlabelled, grammar_tokenizer)
    assert info.value.field == "constraint"
