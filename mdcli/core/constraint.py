"""What the step loop needs of a branch's output constraint (`--choices`, `--regex`, `--schema`).

A constraint is compiled outside core (mdcli/constraints/, bound to the model's tokenizer) and
handed to a branch as a `TokenConstraint`; each branch decoding under it holds its own
`ConstraintState`. Every step the loop asks each constrained tip's state which tokens it allows and
sets the others' logits to -inf before choosing (greedy: the masked argmax; sampled: a draw from
the masked distribution with the branch's own generator), so branches with different constraints,
or none, still choose from one forward. A chosen token advances the state; a state that can take no
more tokens ends the branch ("stop") there, without an EOS token.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ConstraintState(Protocol):
    """One branch's position in its constraint."""

    def allowed(self, into: torch.Tensor) -> None:
        """Write into `into` ([V] bool, V the logits' width) True for every token the constraint
        allows next, False for the others (tokens past the tokenizer's vocabulary included)."""

    def advance(self, token: int) -> None:
        """The branch chose `token` (one `allowed` said True for)."""

    def is_accepting(self) -> bool:
        """What the branch generated so far is a complete answer under the constraint."""

    def is_stopped(self) -> bool:
        """No token but EOS can follow: the branch ends here."""

    def parse(self, text: str) -> object | None:
        """The complete answer `text` as the constraint reads it (a schema's JSON value, a choice,
        the regex's match), or None when `text` is not a valid answer (e.g. a stop string cut it)."""

    def copy(self) -> ConstraintState:
        """An independent state at the same position (a forked child continues from here)."""


class TokenConstraint(Protocol):
    """A constraint compiled for one tokenizer; `start` gives a new branch its own state."""

    description: str  # e.g. "choices: relevant | irrelevant", shown in start/fork records

    def start(self) -> ConstraintState: ...


def mask_rows(logits: torch.Tensor, states: list[ConstraintState | None]) -> torch.Tensor:
    """logits: [k, V], masked in place: row i keeps only the tokens states[i] allows (rows with
    no state are left as they are)."""
    allowed = torch.empty(logits.shape[-1], dtype=torch.bool, device="cpu")  # [V]
    for row, state in enumerate(states):
        if state is not None:
            state.allowed(allowed)
            logits[row].masked_fill_(~allowed.to(logits.device), float("-inf"))
    return logits
