"""Output constraints: `--choices`, `--regex`, `--schema` compiled into token masks.

`Constraint` (spec.py) is the pydantic model every job and recipe uses for a constraint: exactly
one of choices, regex or schema (JSON Schema, or llm's concise form 'name, age int'), checked
without any model (a bad one is a one-line usage error before the model loads). `compile_for`
(matcher.py) binds it to a tokenizer through llguidance, the engine chosen by measurement
(docs/performance.md, "Constraint engines"), and gives core a `TokenConstraint`
(mdcli/core/constraint.py) whose per-branch states core masks the logits with.
"""

from mdcli.constraints.matcher import compile_for
from mdcli.constraints.spec import Constraint, concise_schema

__all__ = ["Constraint", "compile_for", "concise_schema"]
