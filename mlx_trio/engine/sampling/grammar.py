"""Structured output: compile a `Constraint` with llguidance and mask one row's logits by it.

The tokenizer side (`build_grammar_tokenizer`) is built once per model at
load: llguidance reads the HF fast tokenizer's JSON, so it works offline for
any model mlx-lm loads with a `tokenizer.json`. `compile_constraint` turns a
constraint into an llguidance grammar and refuses what it cannot enforce
(an invalid schema or grammar, a schema keyword llguidance does not
implement): a 400 in `Engine.prepare`, never a silently ignored rule.

A `GrammarMatcher` is one row's parser state. Each step the row's allowed
tokens are computed on the host (a bitmask) and applied to its logits as
-inf before sampling; the sampled token is consumed once it has been read.
So the mask for step n+1 needs token n on the host: a batch with a
constrained row cannot queue a step before reading the previous one
(engine/batch/decode_batch.py).

`GrammarMatcher` runs on the lease thread; compiling and the tokenizer are
plain Python/Rust and may run anywhere.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Sequence
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mlx_trio.errors import InvalidParameter
from mlx_trio.params import Constraint

log = logging.getLogger("mlx_trio.grammar")

# Compact JSON: with flexible whitespace a weak model may emit blanks forever inside a
# schema that is otherwise bounded; a schema's own "x-guidance" options still override this.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


def build_grammar_tokenizer(tokenizer: Any, eos_token_ids: Collection[int]) -> llguidance.LLTokenizer | None:
    """llguidance's view of an mlx-lm `TokenizerWrapper`, or None when it cannot read it (a slow tokenizer).

    `eos_token_ids` are every id that ends a request: the grammar allows them
    exactly when the output is complete.
    """
    hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=sorted(eos_token_ids))
    except Exception as exc:  # a tokenizer llguidance cannot read only disables constraints
        log.warning("constrained decoding is unavailable for this tokenizer: %r", exc)
        return None


def compile_constraint(constraint: Constraint, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The llguidance grammar for `constraint`; raises `InvalidParameter` if it cannot be enforced.

    The error names "constraint", or the field of the first bad schema among
    `constraint.schemas` (a grammar built from labelled schemas never shows its own text).
    """
    if constraint.kind == "json_schema":
        return _schema_grammar(constraint.source, tokenizer, field="constraint")
    if constraint.kind != "lark":
        raise InvalidParameter("constraint", f"unknown constraint kind {constraint.kind!r}")
    grammar = llguidance.LLMatcher.grammar_from_lark(constraint.source)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if not is_error:
        return grammar
    for field, schema in constraint.schemas:
        _schema_grammar(schema, tokenizer, field=field)
    if constraint.schemas:
        fields = ", ".join(field for field, _ in constraint.schemas[:3]) + (", …" if len(constraint.schemas) > 3 else "")
        raise InvalidParameter("constraint", f"the schemas of {fields} cannot be enforced together; simplify them")
    raise InvalidParameter("constraint", f"unsupported or invalid grammar: {messages[0].strip()}")


def _schema_grammar(source: str, tokenizer: llguidance.LLTokenizer | None, *, field: str) -> str:
    """The grammar of one JSON schema's text; raises `InvalidParameter(field, ...)` if it cannot be enforced."""
    try:
        schema = json.loads(source)
    except ValueError as exc:
        raise InvalidParameter(field, f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidParameter(field, f"the JSON schema must be an object, got {type(schema).__name__}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except ValueError as exc:
        raise InvalidParameter(field, f"invalid JSON schema: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise InvalidParameter(field, f"unsupported or invalid JSON schema: {messages[0].strip()}")
    return grammar


class GrammarMatcher:
    """One row's grammar state: which tokens may come next, advanced by each token read.

    If the matcher ever fails (a bug: only allowed tokens are sampled), it
    allows only EOS from then on, so the row ends instead of sampling from an
    all -inf distribution.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"grammar failed to compile: {self._matcher.get_error()}")
        self._num_tokens = tokenizer.vocab_size
        self._eos = list(tokenizer.eos_tokens)
        self._bitmask = allocate_token_bitmask(1, self._num_tokens)

    @classmethod
    def for_row(cls, constraint: Constraint | None, tokenizer: llguidance.LLTokenizer | None,
                resumed: Sequence[int] = ()) -> GrammarMatcher | None:
        """A matcher for `constraint` (None without one) that has consumed `resumed`.

        `resumed` are tokens this request generated before a resume (the tail
        of its new prompt): the grammar continues from where it stood.
        """
        if constraint is None:
            return None
        if tokenizer is None:
            raise ValueError("this model's tokenizer does not support constrained decoding")
        matcher = cls(tokenizer, compile_constraint(constraint, tokenizer))
        if resumed:
            matcher.consume(resumed)
        return matcher

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete, or the matcher failed)."""
        return self._matcher.is_stopped()

    def consume(self, token_ids: Sequence[int]) -> None:
        """Advance past tokens that were sampled (and read) for this row.

        Once stopped, the grammar is complete and only EOS was allowed: the
        row ends there, and llguidance refuses to consume anything more.
        """
        if self._matcher.is_stopped():
            return
        if not self._matcher.consume_tokens(list(token_ids)):
            log.error("grammar matcher rejected tokens %s: %s", list(token_ids), self._matcher.get_error())

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading `token_ids` the grammar allows from here (nothing is consumed)."""
        if not token_ids or self._matcher.is_stopped() or self._matcher.is_error():
            return 0
        return self._matcher.validate_tokens(list(token_ids))

    def allowed_along(self, token_ids: Sequence[int], vocab_size: int) -> list[np.ndarray]:
        """The allowed tokens now and after each of `token_ids` (a valid prefix): `len + 1` masks, state unchanged.

        A speculative step samples each position of a proposal under the mask
        the grammar would have there once the proposal before it is consumed.
        """
        masks = [self.allowed_on_host(vocab_size)]
        for token in token_ids:
            self._matcher.consume_token(token)
            masks.append(self.allowed_on_host(vocab_size))
        if token_ids:
            self._matcher.rollback(len(token_ids))
        return masks

    def allowed(self, vocab_size: int) -> mx.array:
        """`[vocab_size]` bool: the tokens the grammar allows next (host-computed, then uploaded)."""
        return mx.array(self.allowed_on_host(vocab_size))

    def allowed_on_host(self, vocab_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """`allowed` as a host array, written into `out` (`[vocab_size]` bool) when given.

        A batch fills one row of its `[B, V]` mask per constrained row and uploads it once.
        """
        allowed = np.zeros(vocab_size, dtype=np.bool_) if out is None else out
        allowed[:] = False
        if not self._matcher.is_error():
            fill_next_token_bitmask(self._matcher, self._bitmask)
            # Bit i of 32-bit word w is token 32*w + i; words are little-endian.
            bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
            n = min(vocab_size, self._num_tokens)
            allowed[:n] = bits[:n].astype(np.bool_)
        if not allowed.any():
            allowed[[t for t in self._eos if t < vocab_size]] = True
        return allowed

    def apply(self, logits: mx.array) -> mx.array:
        """`logits` `[1, V]` with every token the grammar forbids set to -inf."""
        return mx.where(self.allowed(logits.shape[-1]), logits, mx.array(-mx.inf, dtype=logits.dtype))
