"""beam, what a run asks: HF's beam-search knobs (BeamParams, shared with the recipe) and the
prompt or document with questions (Beam, the job)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, Strict

from mdcli.strategies.job import FieldError, Job, Options

EarlyStopping = Union[Annotated[bool, Strict()], Literal["never"]]


class BeamOptions(Options):
    """HF's beam-search knobs, with HF's defaults (GenerationConfig: early_stopping=False,
    length_penalty=1.0): the job's and the recipe's (mdcli/recipes/beam.py) alike."""

    width: int = Field(4, ge=1, strict=True)  # beams kept per prompt (num_beams)
    num_return: int = Field(1, ge=1, strict=True)  # hypotheses returned per prompt, best first
    length_penalty: float = 1.0  # score = logprob / length ** length_penalty
    early_stopping: EarlyStopping = False  # True, False or "never"


_FIELDS = ("width", "num_return", "length_penalty", "early_stopping", "max_new_tokens")


class BeamParams(Job, BeamOptions):
    """The search's settings: BeamOptions and the most new tokens per hypothesis. Positional
    arguments are taken in the order width, num_return, length_penalty, early_stopping,
    max_new_tokens."""

    max_new_tokens: int = Field(64, ge=1)

    def __init__(self, *args: Any, **data: Any) -> None:
        super().__init__(**dict(zip(_FIELDS, args)), **data)

    @classmethod
    def problem(cls, name: str, value: Any, data: dict[str, Any], message: str) -> FieldError:
        if name in ("width", "num_return"):
            return FieldError(f"{{{name}}} must be at least 1 (got {value})", fix=f"use {{{name}}} 1 or more")
        if name == "early_stopping":
            return FieldError(f"{{early_stopping}} must be true, false or never (got {value!r})",
                              fix="use {early_stopping} true|false|never")
        if name == "max_new_tokens":
            return FieldError("{max_new_tokens} must be at least 1", fix="use a positive number")
        return super().problem(name, value, data, message)

    def validate(self) -> None:
        if self.num_return > self.width:
            raise FieldError(
                f"{{num_return}} {self.num_return} is more than {{width}} {self.width}",
                fix="beam search keeps only `width` hypotheses: raise {width} or lower {num_return}",
            )


class Beam(BeamParams):
    """One beam run. Without `questions`, `prompt` is the prompt text: one beam set. With them,
    `prompt` is a document and each question gets its own beam set (`template`, in ask-many form
    with $document and $question; None: ask-many's), all stepping in the same forward."""

    prompt: str
    questions: list[str] = Field(default_factory=list)
    system: str | None = None
    template: str | None = None
    chat_template: bool = True

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)

    @property
    def params(self) -> BeamParams:
        return BeamParams(**{name: getattr(self, name) for name in _FIELDS})


def parse_early_stopping(text: str) -> EarlyStopping:
    """The command line's spelling of HF's `early_stopping` (True, False or "never")."""
    value = {"true": True, "false": False, "never": "never"}.get(text.strip().lower())
    if value is None:
        raise FieldError(f"{{early_stopping}} must be true, false or never (got '{text}')", fix="use true|false|never")
    return value
