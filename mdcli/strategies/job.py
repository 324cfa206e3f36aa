"""What every strategy's job is: a pydantic model whose fields are the strategy's parameters.

A strategy's parameters are declared once, on its options model (`ThinkOptions`, `BeamParams`,
`ExploreOptions`): name, type, default and bounds. The same class is a base of the strategy's
job (what the Python API runs and the command fills) and of its recipe model (what a YAML recipe
is checked against), so the three cannot disagree.

Errors name fields, never command-line flags: a FieldError writes each field as `{name}`. Read as
is it says the field's name ("paths must be at least 1"); the command line spells the same
error with its flags (mdcli/cli/flags.py).

`RunOptions` is the one road for the engine's options (the forward budget, compaction,
speculation), whatever the strategy: the command line, a recipe and an API call each fill one, and
every strategy builds its run from it. A strategy that cannot honour an option refuses it with its
reason (`RunOptions.refuse`), never drops it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mdcli.core.run import Run, RunnableModel
from mdcli.errors import UsageError
from mdcli.speculative.planner import Speculate, parse_speculate

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


class RunOptions(Job):
    """How the engine runs a job, whichever the strategy (core.run.Run.for_model).

    `compact_ratio` None is the strategy's own (0.25; beam search 0.1). `speculate`: "off" (the
    API's default; the command line's is "auto") | "auto" | N draft tokens per branch per step, or
    a Speculate; the tokens are the same either way (mdcli/speculative/planner.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    max_forward_tokens: int = Field(1024, ge=1)  # most new tokens fed in one forward pass
    compact_ratio: float | None = Field(None, ge=0)  # compact the cache when this share of it is dead (0: always)
    speculate: Speculate = Speculate("off")

    @field_validator("speculate", mode="before")
    @classmethod
    def _speculate(cls, value: Any) -> Speculate:
        return parse_speculate(value)

    def refuse(self, strategy: str, **reasons: str) -> RunOptions:
        """These options, if `strategy` can honour them: `reasons` name each option it cannot, with
        why; one that is set (speculation on) is a FieldError in one line."""
        for name, why in reasons.items():
            if name == "speculate" and self.speculate.on:
                raise FieldError(f"{strategy} does not take {{speculate}} {self.speculate}: {why}",
                                 fix="leave {speculate} off")
        return self

    def engine_settings(self) -> dict[str, Any]:
        """What of these options the Engine itself holds (core.engine.Engine's keywords)."""
        return {"max_forward_tokens": self.max_forward_tokens}

    def run(self, model: RunnableModel, *, compact_ratio: float = 0.25) -> Run:
        """A new Run for `model` with these options (`compact_ratio`: the strategy's own, where
        none was asked for)."""
        return Run.for_model(
            model, **self.engine_settings(), speculate=self.speculate,
            compact_ratio=compact_ratio if self.compact_ratio is None else self.compact_ratio,
        )


def run_options(options: RunOptions | None, keywords: dict[str, Any], *, every: bool = False) -> RunOptions:
    """`options`, or RunOptions made of the engine's keywords in `keywords` (taken out of it): the
    API takes either, not both; a keyword given None is not given. `every`: `keywords` hold
    nothing else (a strategy's `**engine`)."""
    engine = {name: keywords.pop(name) for name in RunOptions.model_fields if name in keywords}
    engine = {name: value for name, value in engine.items() if value is not None}
    if every and keywords:
        raise TypeError(f"unknown run options: {', '.join(keywords)} (RunOptions has {', '.join(RunOptions.model_fields)})")
    if options is None:
        return RunOptions(**engine)
    if engine:
        raise TypeError(f"the run's options were given twice: options= and {', '.join(engine)}")
    return options
