"""What every strategy's job is: a pydantic model whose fields are the strategy's parameters.

A strategy's parameters are declared once, on its options model (`ThinkOptions`, `BeamParams`,
`ExploreOptions`): name, type, default and bounds. The same class is a base of the strategy's
job (what the Python API runs and the command fills) and of its recipe model (what a YAML recipe
is checked against), so the three cannot disagree.

Errors name fields, never command-line flags: a FieldError writes each field as `{name}`. Read as
is it says the field's name ("paths must be at least 1"); the command line spells the same
error with its flags (mdcli/cli/flags.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from mdcli.errors import UsageError

_FIELD = re.compile(r"\{([a-z][a-z0-9_]*)\}")


def spell(text: str, name: Callable[[str], str] = str) -> str:
    """`text` with every `{field}` written as `name(field)`."""
    return _FIELD.sub(lambda match: name(match[1]), text)


class FieldError(UsageError):
    """A usage error about a job's fields, each written `{field}` in its texts."""

    def __init__(self, problem: str, *, fix: str | None = None) -> None:
        self.texts = (problem, fix)
        super().__init__(spell(problem), fix=None if fix is None else spell(fix))

    def spelled(self, name: Callable[[str], str]) -> UsageError:
        """The same error with each field written as `name(field)` (e.g. its flag)."""
        problem, fix = self.texts
        return UsageError(spell(problem, name), fix=None if fix is None else spell(fix, name))


def at_least_one(name: str, value: Any) -> FieldError:
    return FieldError(f"{{{name}}} must be at least 1 (got {value})", fix="use a positive number")


class Options(BaseModel):
    """A strategy's parameters: unknown names are errors."""

    model_config = ConfigDict(extra="forbid")


class Job(Options):
    """A strategy's job. A value the fields' types or bounds refuse is a FieldError (exit 2), in the
    words of `problem`, not pydantic's."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            first = error.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else ""
            cause = first.get("ctx", {}).get("error")
            if hasattr(cause, "problem") and hasattr(cause, "fix"):  # a field's own words (e.g. a ConstraintError)
                raise FieldError(f"{{{name}}}: {cause.problem}", fix=cause.fix) from None
            raise self.problem(name, first.get("input"), data, first["msg"]) from None

    @classmethod
    def problem(cls, name: str, value: Any, data: dict[str, Any], message: str) -> FieldError:
        """The error for field `name` refusing `value` (`data`: every value given). Jobs override
        this for their own words; this says what pydantic said, about the field."""
        if message.startswith("Input should be greater than or equal to 1"):
            return at_least_one(name, value)
        return FieldError(f"{{{name}}}: {message} (got {value!r})", fix="see the field's documentation")
