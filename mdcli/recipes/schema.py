"""The recipe schema: what every strategy's recipe has, and the parts they share.

A strategy's recipe is a RecipeBase subclass with `strategy: Literal["its-name"]` and its own
fields, in a module of its own (mdcli/recipes/<strategy>.py), listed once in registry.py. It
carries its own behaviour as methods, so no code elsewhere asks which strategy a recipe is:

    check(var_names)      the rules its schema cannot state (the common ones: checks.check_recipe)
    template_sites()      every text that takes `$variables`, and what it is for
    events(model, ...)    running it: the events of its API function
    branch_specs(...)     (recipes with a branch list) the BranchSpecs, for `mdcli explain`
    speculation(flag)     its speculative decoding setting
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from mdcli.constraints import Constraint
from mdcli.errors import RecipeError
from mdcli.core.sampling import SamplingParams
from mdcli.speculative.planner import Speculate, parse_speculate
from mdcli.strategies.ask_many import AskMany
from mdcli.strategies.job import RunOptions

if TYPE_CHECKING:
    from mdcli.core.decoding import BranchSpec
    from mdcli.events import Event
    from mdcli.models.load import LoadedModel

RECIPE_VERSION = 1
DEFAULT_MAX_NEW_TOKENS = AskMany.model_fields["max_new_tokens"].default  # per branch, when no layer states it


class Strict(BaseModel):
    """Unknown keys are errors (a typo must not be ignored), and no silent type coercion:
    `max_new_tokens: "12"` or `temperature: .nan` is a mistake to report, not to guess at."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _layer_field(name: str) -> Any:
    """SamplingParams' field `name`, its type and bounds as written there, optional (None: unset)."""
    field = SamplingParams.model_fields[name]
    bounded = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return bounded | None


def stated_sampling(sampling: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """A saved recipe's `sampling:` for a job's sampler: every field stated, the seed where set."""
    stated: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                              "min_p": sampling.min_p, "max_new_tokens": max_new_tokens}
    if sampling.seed is not None:
        stated["seed"] = sampling.seed
    return stated


class Sampling(Strict):
    """A `sampling:` layer (recipe, branch, command line): the sampler's fields (SamplingParams:
    types and bounds are written there) plus the branch's limits. Every field is optional: a layer
    states only what it changes (None, or absent, is unset), and the rest comes from the layer
    around it (`then`): recipe -> branch -> child, with command-line flags on top."""

    temperature: _layer_field("temperature") = None
    top_p: _layer_field("top_p") = None
    top_k: _layer_field("top_k") = None
    min_p: _layer_field("min_p") = None
    seed: _layer_field("seed") = None
    max_new_tokens: int | None = Field(None, ge=1)
    stop: list[str] | None = None

    def stated(self) -> dict[str, Any]:
        """The fields this layer sets."""
        return {name: value for name, value in self if value is not None}

    def then(self, layer: Sampling | None) -> Sampling:
        """These settings with the fields `layer` states on top (None: no layer)."""
        return self if layer is None else self.model_copy(update=layer.stated())

    def without(self, names: Iterable[str]) -> Sampling:
        """This layer with `names` unset, so they come from the layer around it again."""
        return self.model_copy(update=dict.fromkeys(names))

    def params(self) -> SamplingParams:
        """The sampler's settings: what the layers state, SamplingParams' defaults for the rest."""
        return SamplingParams(**{k: v for k, v in self.stated().items() if k in SamplingParams.model_fields})

    def new_tokens(self, default: int = DEFAULT_MAX_NEW_TOKENS) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else default

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class Context(Strict):
    """The shared document: exactly one of `text`, `file` (relative to the recipe), `files` (paths,
    folders or globs relative to the recipe, read as several documents) or `input: true` (what
    --input gives, or stdin)."""

    text: str | None = None
    file: str | None = None
    files: list[str] | None = None
    input: bool | None = None


class Branch(Strict):
    """One branch: a user turn. Children fork when it finishes, continuing from its answer."""

    label: str
    prompt: str
    sampling: Sampling | None = None
    constraint: Constraint | None = None  # its answer's shape; else the recipe's `constraint:`
    children: list[Branch] = Field(default_factory=list)


@dataclass(frozen=True)
class TemplateSite:
    """A piece of recipe text that is a `$variable` template, and what it is for: `root` is a
    whole prompt (it must read the context), `child` a follow-up turn, `question` an ask-many
    question (filled into `template`), `query` a question that must not contain the context."""

    path: tuple
    text: str
    role: Literal["root", "child", "question", "template", "query"]


class RecipeBase(Strict):
    """What every strategy's recipe has. Subclasses add `strategy: Literal[...]`, their fields and
    their behaviour (the methods below)."""

    version: Literal[1]
    description: str | None = None
    context: Context | None = None
    system: str | None = None
    chat_template: bool = True
    vars: dict[str, str | None] = Field(default_factory=dict)
    sampling: Sampling = Field(default_factory=Sampling)
    # speculative decoding: "auto" | "off" | N draft tokens per branch per step (never changes tokens)
    speculate: Literal["auto", "off"] | Annotated[int, Field(ge=0)] | None = None
    # the prompt cache: "auto" | "off" | a folder (--prompt-cache wins; neither given: auto)
    prompt_cache: Annotated[str, Field(min_length=1)] | None = None

    @field_validator("speculate", "prompt_cache", mode="before")
    @classmethod
    def _yaml_switch_words(cls, value: object) -> object:
        """YAML 1.1 reads `speculate: off` (or no/false) as False and on/yes/true as True: they mean
        "off" and "auto" (guess where it pays; the prompt cache's folder) here, not 0 and 1."""
        if isinstance(value, bool):
            return "auto" if value else "off"
        return value

    # the fix for a number out of range in one of this strategy's own fields, by field name
    field_fixes: ClassVar[dict[str, str]] = {}
    # `mdcli run RECIPE --each` runs this strategy's recipes: each_job is the job asked of every document
    runs_each: ClassVar[bool] = False

    # where the recipe came from: error messages name it, `context.file` is relative to it
    _source: str = PrivateAttr("recipe")
    _base_dir: Path | None = PrivateAttr(None)

    @property
    def source(self) -> str:
        return self._source

    @property
    def base_dir(self) -> Path:
        return self._base_dir or Path.cwd()

    @classmethod
    def strategy_name(cls) -> str:
        return cls.model_fields["strategy"].annotation.__args__[0]


    # -- what a strategy's recipe overrides ---------------------------------------------------

    def check(self, var_names: set[str]) -> None:
        """This strategy's own rules that a schema cannot state. Raises errors.Problem."""

    def template_sites(self) -> Iterator[TemplateSite]:
        """Every text in the recipe that takes `$variables`."""
        return iter(())

    def branch_tree(self) -> list[Branch]:
        """The recipe's branches (each may carry its own `sampling:`), if it has a branch list."""
        return []

    def speculation(self, flag: str | None) -> Speculate | None:
        """--speculate wins over the recipe's `speculate`."""
        return parse_speculate(flag if flag is not None else self.speculate)

    def run_options(self, options: RunOptions) -> RunOptions:
        """The run's options: a `speculate` set in `options` (--speculate) wins over the recipe's,
        and a recipe that cannot speculate refuses either (`speculation`)."""
        flag = options.speculate if "speculate" in options.model_fields_set else None
        return options.model_copy(update={"speculate": self.speculation(flag) or Speculate("off")})

    def branch_specs(self, tokenizer, *, input_text: str | None, vars: dict[str, str] | None) -> list[BranchSpec]:
        """The root BranchSpecs (children nested) of a recipe that is a list of branches."""
        raise RecipeError(
            f"{self.source}: strategy: a {self.strategy_name()} recipe has no branch list to compile",
            fix=f"run it with: mdcli run {self.source.removesuffix(' (built-in)').removesuffix('.yaml')}",
        )

    def each_job(self, values: dict[str, str]) -> Any:
        """The job (an AskMany or a Margins) that `mdcli run RECIPE --each` asks of every document on
        its own (api.ask_each), its variables' values known ($context aside); `runs_each` says there
        is one. Raises errors.Problem."""
        raise NotImplementedError(f"strategy {self.strategy_name()} has no --each")

    def events(
        self, model: LoadedModel, values: dict[str, str], context: str | None, *,
        options: RunOptions,
    ) -> Iterator[Event]:
        """The events of running the recipe: `values` are its variables ($context included when it
        has one), `context` its context text. Arguments are checked before the first event."""
        raise NotImplementedError(f"strategy {self.strategy_name()} has no events()")
