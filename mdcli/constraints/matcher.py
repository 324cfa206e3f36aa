"""A `Constraint` bound to a model's tokenizer: llguidance matchers behind core's protocol.

`compile_for(constraint, tokenizer)` gives core a `TokenConstraint` (mdcli/core/constraint.py);
each branch's `start()` is its own `LLMatcher`. The tokenizer's llguidance form costs about 0.3 s
to build (49k tokens), so it is built once per tokenizer and kept beside it in a weak-keyed cache
here (nothing is stored on the tokenizer object itself); compiling a constraint then takes about a
millisecond, and a mask per step 20-40 us (docs/performance.md, "Constraint engines").
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import llguidance
import llguidance.hf
import torch

from mdcli.constraints.spec import Constraint
from mdcli.core.constraint import ConstraintState
from mdcli.errors import UsageError

_TOKENIZERS: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()

# byte value -> its 8 bits, least significant first: the order llguidance packs tokens in
_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]


def grammar_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for a Hugging Face fast tokenizer, built once per tokenizer."""
    cached = _TOKENIZERS.get(tokenizer)
    if cached is None:
        try:
            cached = llguidance.hf.from_tokenizer(tokenizer)
        except ValueError:
            raise UsageError(
                "output constraints need a fast (Rust) tokenizer, and this model's is not one",
                fix="drop --choices/--regex/--schema, or use a model with a tokenizer.json",
            ) from None
        _TOKENIZERS[tokenizer] = cached
    return cached


class CompiledConstraint:
    """A constraint ready for branches of one tokenizer (core's TokenConstraint)."""

    def __init__(self, constraint: Constraint, tokenizer) -> None:
        self.constraint = constraint
        self.description = constraint.describe()
        self.tokenizer = grammar_tokenizer(tokenizer)
        self.grammar = constraint.grammar()

    def start(self) -> MatcherState:
        return MatcherState(self, llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0))


class MatcherState:
    """One branch's llguidance matcher (core's ConstraintState)."""

    def __init__(self, compiled: CompiledConstraint, matcher: llguidance.LLMatcher) -> None:
        self.compiled = compiled
        self.matcher = matcher

    def allowed(self, into: torch.Tensor) -> None:
        """into: [V] bool <- the next-token mask; tokens past the tokenizer's vocabulary are False."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)  # [ceil(n/32) * 4]
        bits = _BITS[words.long()].flatten()  # [ceil(n/32) * 32]
        width = min(into.shape[0], self.compiled.tokenizer.vocab_size)
        into.zero_()
        into[:width] = bits[:width]

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    def parse(self, text: str) -> object | None:
        constraint = self.compiled.constraint
        if constraint.choices is not None:
            return text if text in constraint.choices else None
        if constraint.regex is not None:
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return None

    def copy(self) -> ConstraintState:
        return MatcherState(self.compiled, self.matcher.deep_copy())


def compile_for(constraint: Constraint | None, tokenizer) -> CompiledConstraint | None:
    """`constraint` bound to `tokenizer` (None stays None)."""
    return None if constraint is None else CompiledConstraint(constraint, tokenizer)
