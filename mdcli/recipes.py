"""Recipes: a forest of branches, its shared context and its sampling, written down as YAML.

A recipe is data, never code. It is parsed by PyYAML's SafeLoader (so `!!python/...` tags are
refused) and checked by pydantic models that forbid unknown keys, then by cross-field checks that
a schema cannot express (unique labels, defined variables, a context that every root reads).
Every problem becomes ONE line, `<file>: <field path>: <problem>; <fix>` (a RecipeError, exit 2):
the reader has to find the spot in their file and know what to type there.

Three stages, each usable alone:

    load_recipe / load_recipe_text   YAML -> Recipe          (no model needed: `recipes validate`)
    with_sampling                    Recipe -> Recipe        (command-line flags win over the file)
    compile_recipe                   Recipe -> [BranchSpec]  (fills variables, tokenizes)

Adding a strategy (beam, margins, think) is one more `RecipeBase` subclass with
`strategy: Literal["its-name"]`, listed in STRATEGY_MODELS; the discriminated union, the
"unknown strategy" message and the "that key belongs to strategy X" message follow from that list.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError

from mdcli.errors import RecipeError, UsageError
from mdcli.strategies.ask_many import DEFAULT_TEMPLATE as ASK_MANY_DOCUMENT_TEMPLATE

if TYPE_CHECKING:
    from mdcli.decoding import BranchSpec
    from mdcli.events import Event

RECIPE_VERSION = 1
BUILTIN_PACKAGE = "mdcli.recipes_builtin"
RESERVED_VARIABLES = ("context", "question")


# -- the schema --------------------------------------------------------------------------------


class _Strict(BaseModel):
    """Unknown keys are errors (a typo must not be ignored), and no silent type coercion:
    `max_new_tokens: "12"` or `temperature: .nan` is a mistake to report, not to guess at."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Sampling(_Strict):
    """Sampling settings. Every field is optional: a layer (recipe, branch, command line) states
    only what it changes, and the rest comes from the layer below."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    seed: int | None = None
    max_new_tokens: int | None = Field(None, ge=1)
    stop: list[str] | None = None


class Context(_Strict):
    """The shared document: exactly one of `text`, `file` (relative to the recipe) or `input: true`
    (the text given with --input, or stdin)."""

    text: str | None = None
    file: str | None = None
    input: bool | None = None


class Branch(_Strict):
    """One branch: a user turn. Children fork when it finishes, continuing from its answer."""

    label: str
    prompt: str
    sampling: Sampling | None = None
    children: list[Branch] = Field(default_factory=list)


class RecipeBase(_Strict):
    """What every strategy's recipe has. Subclasses add `strategy: Literal[...]` and their fields."""

    version: Literal[1]
    description: str | None = None
    context: Context | None = None
    system: str | None = None
    chat_template: bool = True
    vars: dict[str, str | None] = Field(default_factory=dict)
    sampling: Sampling = Field(default_factory=Sampling)
    # speculative decoding: "auto" | "off" | N draft tokens per branch per step (never changes tokens)
    speculate: Literal["auto", "off"] | Annotated[int, Field(ge=0)] | None = None

    # where the recipe came from: error messages name it, `context.file` is relative to it
    _source: str = PrivateAttr("recipe")
    _base_dir: Path | None = PrivateAttr(None)

    @property
    def source(self) -> str:
        return self._source

    @property
    def base_dir(self) -> Path:
        return self._base_dir or Path.cwd()


class AskManyRecipe(RecipeBase):
    """ask-many: independent branches over one context. `questions` + `template` is shorthand for
    a flat `branches` list: each question becomes a branch labelled by the question."""

    strategy: Literal["ask-many"]
    questions: list[str] | None = None
    template: str | None = None
    branches: list[Branch] | None = None


class TreeRecipe(RecipeBase):
    """tree: branches with follow-ups; a child forks when its parent finishes."""

    strategy: Literal["tree"]
    branches: list[Branch]


class BeamRecipe(RecipeBase):
    """beam: exact beam search (generate(num_beams=width)). `prompt` is the whole prompt (it may
    use $context and $vars); or `questions` (+ optional `template`), one beam set per question
    over the context. Greedy by nature: of `sampling`, only max_new_tokens applies (default 64)."""

    strategy: Literal["beam"]
    prompt: str | None = None
    questions: list[str] | None = None
    template: str | None = None
    width: int = Field(4, ge=1)
    num_return: int = Field(1, ge=1)
    length_penalty: float = 1.0
    early_stopping: Any = False  # true | false | "never", checked in check_recipe (one clear message)


class MarginsRecipe(RecipeBase):
    """margins: Writing in the Margins over the context (the document). `query` (one question)
    or `questions` (several, sharing one cache). `sampling.max_new_tokens` bounds each margin;
    the classification and answer have their own limits."""

    strategy: Literal["margins"]
    query: str | None = None
    questions: list[str] | None = None
    layout: Literal["chain", "independent"] | None = None
    segment_tokens: int | None = Field(None, ge=1)
    keep: Literal["all", "relevant"] = "relevant"
    classify: bool = True
    with_segments: bool = False
    margin_template: str | None = None
    classification_template: str | None = None
    answer_template: str | None = None
    classify_tokens: int | None = Field(None, ge=1)
    answer_tokens: int | None = Field(None, ge=1)


class ThinkRecipe(RecipeBase):
    """think: parallel chains of thought over one question (which may use $context), then a
    merged conclusion and/or a vote."""

    strategy: Literal["think"]
    question: str
    paths: int = Field(4, ge=1)
    plan: bool = False
    max_paths: int = Field(8, ge=1)
    merge: Literal["reencode", "attend", "none"] | None = None
    vote: bool = False
    answer_pattern: str | None = None
    path_instructions: list[str] = Field(default_factory=list)
    plan_tokens: int = Field(128, ge=1)
    conclusion_tokens: int = Field(256, ge=1)


STRATEGY_MODELS: tuple[type[RecipeBase], ...] = (AskManyRecipe, TreeRecipe, BeamRecipe, MarginsRecipe, ThinkRecipe)
Recipe = AskManyRecipe | TreeRecipe | BeamRecipe | MarginsRecipe | ThinkRecipe
_RECIPE_ADAPTER: TypeAdapter = TypeAdapter(
    Annotated[Union[STRATEGY_MODELS], Field(discriminator="strategy")]  # noqa: UP007 - built from a tuple
)


def strategy_names() -> list[str]:
    return [_strategy_name(model) for model in STRATEGY_MODELS]


def _strategy_name(model: type[RecipeBase]) -> str:
    return model.model_fields["strategy"].annotation.__args__[0]


# -- errors ------------------------------------------------------------------------------------


@dataclass
class _Problem(Exception):
    """A problem at a field path, before the file name is known to the code that finds it."""

    path: tuple
    problem: str
    fix: str


def _error(source: str, path: tuple | str, problem: str, fix: str) -> RecipeError:
    where = path if isinstance(path, str) else format_path(path)
    return RecipeError(_one_line(f"{source}: {where}: {problem}"), fix=_one_line(fix))


def format_path(path: Iterable) -> str:
    """("branches", 1, "children", 0, "prompt") -> "branches[1].children[0].prompt"."""
    text = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text or "(top level)"


def _one_line(text: str) -> str:
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= 400 else text[:400] + "…"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


# -- reading YAML ------------------------------------------------------------------------------


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader (what yaml.safe_load uses), plus one refusal: a key written twice in a
    mapping. Plain safe_load keeps the last one and silently drops the other."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set[tuple[str, str]] = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"the key '{key_node.value}' appears twice", key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, source: str) -> Any:
    """The YAML document, or a RecipeError pointing at the line and column of the problem."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader subclass: safe_load + one check
    except yaml.MarkedYAMLError as error:
        raise _yaml_error(error, source) from None
    except yaml.YAMLError as error:
        raise _error(source, "(file)", f"invalid YAML: {error}", "check the file is a YAML mapping") from None
    except RecursionError:
        raise _error(source, "(file)", "invalid YAML: nested too deeply", "flatten the document") from None


def _yaml_error(error: yaml.MarkedYAMLError, source: str) -> RecipeError:
    mark = error.problem_mark or error.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
    problem = error.problem or str(error)
    tag = re.search(r"tag '([^']*)'", problem)
    if isinstance(error, yaml.constructor.ConstructorError) and tag:
        shown = tag.group(1).replace("tag:yaml.org,2002:", "!!")
        return _error(
            source, where, f"the tag {shown} is not allowed",
            "remove it: a recipe is plain YAML data (text, numbers, lists, mappings), never code",
        )
    if "appears twice" in problem:
        return _error(source, where, problem, "keep one of them")
    return _error(source, where, f"invalid YAML: {problem}", "check the indentation and quoting on that line")


# -- loading -----------------------------------------------------------------------------------


def load_recipe(name_or_path: str | Path, *, var_names: Iterable[str] = ()) -> Recipe:
    """Load a recipe file, or a built-in recipe by name (`interview`, `follow-ups`, ...)."""
    text, source, base_dir = read_recipe_source(name_or_path)
    return load_recipe_text(text, source=source, base_dir=base_dir, var_names=var_names)


def load_recipe_text(
    text: str, *, source: str = "recipe", base_dir: Path | None = None, var_names: Iterable[str] = ()
) -> Recipe:
    """Parse and check a recipe. `var_names` are the variables the command line will give (--var),
    which the file need not declare. Raises RecipeError (and nothing else) on any problem."""
    data = parse_yaml(text, source)
    return validate_recipe_data(data, source=source, base_dir=base_dir, var_names=var_names)


def validate_recipe_data(
    data: Any, *, source: str = "recipe", base_dir: Path | None = None, var_names: Iterable[str] = ()
) -> Recipe:
    """Check plain data (what YAML gives) against the schema and the cross-field rules."""
    try:
        _check_shape(data)
        recipe = _validate_schema(data)
        recipe._source, recipe._base_dir = source, base_dir
        check_recipe(recipe, set(var_names))
    except _Problem as problem:
        raise _error(source, problem.path, problem.problem, problem.fix) from None
    except RecursionError:
        raise _error(source, "(top level)", "nested too deeply", "flatten the recipe") from None
    return recipe


def _check_shape(data: Any) -> None:
    """What must hold before the schema can say anything useful: a mapping, version 1, no cycles."""
    if not isinstance(data, dict):
        kind = "an empty file" if data is None else _yaml_kind(data)
        raise _Problem((), f"a recipe is a YAML mapping, got {kind}", "start the file with `version: 1`")
    if "version" not in data:
        raise _Problem(("version",), "missing", f"add `version: {RECIPE_VERSION}` at the top")
    if data["version"] != RECIPE_VERSION or isinstance(data["version"], bool):
        raise _Problem(
            ("version",), f"unsupported version {_short(data['version'])}",
            f"this mdcli reads `version: {RECIPE_VERSION}` recipes",
        )
    cycle = _find_cycle(data)
    if cycle is not None:
        raise _Problem(
            cycle, "this part contains itself through a YAML alias (a cycle)",
            "a branch tree cannot contain itself: write the nested branches out instead of aliasing an ancestor",
        )


def _find_cycle(node: Any, path: tuple = (), on_path: set[int] | None = None, done: set[int] | None = None):
    """The path of a container that is its own ancestor (YAML `&a` ... `*a` inside itself), or None.

    Shared (aliased) but acyclic parts are visited once, so alias-heavy files stay linear."""
    on_path = set() if on_path is None else on_path
    done = set() if done is None else done
    if not isinstance(node, (dict, list)) or id(node) in done:
        return None
    if id(node) in on_path:
        return path
    on_path.add(id(node))
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, child in items:
        found = _find_cycle(child, (*path, key), on_path, done)
        if found is not None:
            return found
    on_path.discard(id(node))
    done.add(id(node))
    return None


def _validate_schema(data: dict) -> Recipe:
    try:
        return _RECIPE_ADAPTER.validate_python(data)
    except ValidationError as error:
        raise _problem_from_pydantic(error.errors()[0], data) from None
    except RecursionError:
        raise _Problem((), "nested too deeply", "flatten the recipe") from None


# -- schema errors in words --------------------------------------------------------------------

_FIELD_HINTS = {
    "label": "`label: a-short-name`",
    "prompt": "`prompt: <the user-turn text>`",
    "branches": "`branches:` with a list of branches (each with label and prompt)",
    "strategy": "`strategy: ask-many` (or tree, beam, margins, think)",
}
_RANGE_FIXES = {
    "temperature": "use 0 for greedy decoding or a positive number",
    "top_p": "use a number in (0, 1]; 1 turns it off",
    "top_k": "use 0 (off) or a positive whole number",
    "min_p": "use a number in [0, 1); 0 turns it off",
    "max_new_tokens": "use a whole number of at least 1",
    "width": "use a whole number of at least 1 (the number of beams)",
    "num_return": "use a whole number of at least 1 (and at most width)",
}
_TYPE_WORDS = {
    "string_type": "text",
    "int_type": "a whole number",
    "float_type": "a number",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def _problem_from_pydantic(error: dict, data: dict) -> _Problem:
    """One pydantic error -> a problem in recipe words, with the discriminator tag dropped from the path."""
    kind, loc, given = error["type"], tuple(error["loc"]), error.get("input")
    strategy = data.get("strategy")
    if loc and loc[0] == strategy:
        loc = loc[1:]
    names = ", ".join(strategy_names())
    if kind == "union_tag_invalid":
        return _Problem(("strategy",), f"unknown strategy {_short(strategy)}", f"use one of: {names}")
    if kind == "union_tag_not_found":
        return _Problem(("strategy",), "missing", f"add `strategy:` with one of: {names}")
    if kind == "missing":
        field = loc[-1] if loc else ""
        return _Problem(loc, "missing required field", f"add {_FIELD_HINTS.get(field, f'`{field}:`')}")
    if kind == "extra_forbidden":
        return _unknown_key_problem(loc, strategy)
    if kind in _TYPE_WORDS:
        return _Problem(loc, f"expected {_TYPE_WORDS[kind]}, got {_yaml_kind(given)}", _type_fix(kind, given))
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"):
        field = next((part for part in reversed(loc) if isinstance(part, str)), "")
        bound = error["msg"].removeprefix("Input should be ")
        fix = _RANGE_FIXES.get(field, "fix the value")
        return _Problem(loc, f"{_short(given)} is out of range (must be {bound})", fix)
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return _Problem(loc, f"{_short(given)} is not allowed", f"use {expected}")
    if kind == "invalid_key":
        key_path = (*loc[:-1], str(loc[-1])) if loc else loc  # a mapping key, not a list index
        return _Problem(key_path, f"the key {_short(given)} is not text", "write mapping keys as names")
    if kind == "recursion_loop":
        return _Problem(loc, "this part contains itself (a cycle)", "write the branches out instead of aliasing")
    return _Problem(loc, error["msg"], "see docs/recipes.md for the recipe format")


def _unknown_key_problem(loc: tuple, strategy: Any) -> _Problem:
    key = loc[-1] if loc else "?"
    parent = loc[:-1]
    if not parent:
        owners = [_strategy_name(m) for m in STRATEGY_MODELS if key in m.model_fields and _strategy_name(m) != strategy]
        if owners:
            return _Problem(
                loc, f"'{key}' is a setting of strategy {' / '.join(owners)}, not {strategy}",
                f"remove it, or set `strategy: {owners[0]}`",
            )
    allowed = _allowed_keys(strategy, parent)
    fix = f"remove it or fix its spelling; allowed here: {', '.join(allowed)}" if allowed else "remove it"
    return _Problem(loc, f"unknown key {_short(key)}", fix)


def _allowed_keys(strategy: Any, path: tuple) -> list[str]:
    """The keys the schema accepts at `path` (for "did you mean" help)."""
    model: Any = next((m for m in STRATEGY_MODELS if _strategy_name(m) == strategy), None)
    for part in path:
        if model is None:
            return []
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field else None
    return list(model.model_fields) if model is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside `Optional[list[Model]]` and the like."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _yaml_kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"the number {_short(value)}"
    if isinstance(value, str):
        return f"the text {_short(value)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _type_fix(kind: str, given: Any) -> str:
    if kind == "string_type" and isinstance(given, (int, float, bool)):
        return "put it in quotes"
    if kind == "string_type" and given is None:
        return "write the text after the colon (or remove the key)"
    if kind == "list_type":
        return "write it as a YAML list, one `- item` per line"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "write it as a mapping of `key: value` lines"
    if kind == "bool_type":
        return "write true or false"
    return f"write {_TYPE_WORDS[kind]}"


# -- cross-field checks ------------------------------------------------------------------------


@dataclass(frozen=True)
class TemplateSite:
    """A piece of recipe text that is a `$variable` template, and what it is for."""

    path: tuple
    text: str
    role: Literal["root", "child", "question", "template", "query"]


def check_recipe(recipe: Recipe, var_names: set[str]) -> None:
    """The rules a schema cannot state. Raises _Problem."""
    _check_context(recipe)
    _check_declared_vars(recipe)
    if isinstance(recipe, AskManyRecipe):
        _check_ask_many_source(recipe)
    if isinstance(recipe, BeamRecipe):
        _check_beam(recipe)
    if isinstance(recipe, MarginsRecipe):
        _check_margins(recipe)
    if isinstance(recipe, ThinkRecipe):
        _check_think(recipe)
    if getattr(recipe, "branches", None) is not None:
        _check_branch_list(recipe.branches, ("branches",), nested=not isinstance(recipe, AskManyRecipe))
    sites = list(template_sites(recipe))
    for site in sites:
        _check_template(site, recipe, var_names)
    _check_vars_used(recipe, sites)


def _check_context(recipe: Recipe) -> None:
    context = recipe.context
    if context is None:
        return
    given = [name for name in ("text", "file") if getattr(context, name) is not None]
    given += ["input"] if context.input else []
    if len(given) != 1:
        problem = "is empty" if not given else f"gives {' and '.join(given)}"
        raise _Problem(("context",), problem, "give exactly one of `text: ...`, `file: path` or `input: true`")
    if context.text is not None and not context.text.strip():
        raise _Problem(("context", "text"), "is empty", "write the context text, or remove `context:`")
    if context.file is not None:
        path = recipe.base_dir / context.file
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            raise _Problem(
                ("context", "file"), f"'{context.file}' {what} (looked for {path})",
                "give the path of a text file, relative to the recipe file",
            )


def _check_declared_vars(recipe: Recipe) -> None:
    for name in recipe.vars:
        if not _is_identifier(name):
            raise _Problem(("vars", name), "is not a variable name", "use letters, digits and _ (not first a digit)")
        if name in RESERVED_VARIABLES:
            raise _Problem(("vars", name), f"${name} is filled by mdcli", f"rename it; {name} cannot be set")


def _check_ask_many_source(recipe: AskManyRecipe) -> None:
    if recipe.questions is None and recipe.branches is None:
        raise _Problem(("questions",), "missing", "add `questions:` (a list), or `branches:`")
    if recipe.questions is not None and recipe.branches is not None:
        raise _Problem(("branches",), "questions and branches are both given", "keep one of them")
    if recipe.template is not None and recipe.questions is None:
        raise _Problem(("template",), "only applies to `questions:`", "remove it, or use questions instead of branches")
    if recipe.questions is not None:
        _check_questions(recipe.questions)
    for index, branch in enumerate(recipe.branches or []):
        if branch.children:
            raise _Problem(
                ("branches", index, "children"), "ask-many branches cannot have children",
                "use `strategy: tree` for follow-up questions",
            )


def _check_beam(recipe: BeamRecipe) -> None:
    if recipe.prompt is None and recipe.questions is None:
        raise _Problem(("prompt",), "missing", "add `prompt:` (the prompt text), or `questions:` (a list)")
    if recipe.prompt is not None and recipe.questions is not None:
        raise _Problem(("questions",), "prompt and questions are both given", "keep one of them")
    if recipe.template is not None and recipe.questions is None:
        raise _Problem(("template",), "only applies to `questions:`", "remove it, or use questions instead of prompt")
    if recipe.prompt is not None and not recipe.prompt.strip():
        raise _Problem(("prompt",), "is empty", "write the prompt text")
    if recipe.questions is not None:
        _check_questions(recipe.questions)
        if recipe.context is None:
            raise _Problem(
                ("context",), "beam questions are asked about a context, but the recipe has none",
                "add `context: {input: true}` (or text: / file:), or use `prompt:` instead",
            )
    if recipe.num_return > recipe.width:
        raise _Problem(
            ("num_return",), f"{recipe.num_return} is more than width {recipe.width}",
            "use num_return <= width (beam search keeps width hypotheses)",
        )
    if not (isinstance(recipe.early_stopping, bool) or recipe.early_stopping == "never"):
        raise _Problem(("early_stopping",), f"{_short(recipe.early_stopping)} is not allowed", "use true, false or never")


def _check_margins(recipe: MarginsRecipe) -> None:
    if recipe.context is None:
        raise _Problem(("context",), "missing: margins reads a document", "add `context: {input: true}` (or text: / file:)")
    if (recipe.query is None) == (recipe.questions is None):
        raise _Problem(
            ("query",), "give `query:` (one question) or `questions:` (a list), not both" if recipe.query is not None
            else "missing: margins needs a question", "write `query: ...` or `questions: [...]`",
        )
    if recipe.questions is not None:
        _check_questions(recipe.questions)
    elif not recipe.query.strip():
        raise _Problem(("query",), "is empty", "write the question to answer from the document")
    fields = {"margin_template": "margin", "classification_template": "classification", "answer_template": "answer"}
    for field, name in fields.items():
        text = getattr(recipe, field)
        if text is None:
            continue
        try:
            dataclasses.replace(_default_margins_prompts(), **{name: text}).check()
        except UsageError as error:
            raise _Problem((field,), error.problem, error.fix or "see docs/recipes.md") from None


def _default_margins_prompts():
    from mdcli.strategies.margins import MarginsPrompts

    return MarginsPrompts()


def _check_think(recipe: ThinkRecipe) -> None:
    if not recipe.question.strip():
        raise _Problem(("question",), "is empty", "write the question to think about")
    for index, instruction in enumerate(recipe.path_instructions):
        if not instruction.strip():
            raise _Problem(("path_instructions", index), "is empty", "write the instruction or remove it")
    if recipe.answer_pattern is not None:
        try:
            re.compile(recipe.answer_pattern)
        except re.error as error:
            raise _Problem(("answer_pattern",), f"is not a valid regular expression: {error}", "fix the pattern") from None


def _check_questions(questions: list[str]) -> None:
    if not questions:
        raise _Problem(("questions",), "the question list is empty", "add at least one question")
    first_at: dict[str, int] = {}
    for index, question in enumerate(questions):
        if not question.strip():
            raise _Problem(("questions", index), "is empty", "write the question or remove it")
        if question in first_at:
            raise _Problem(
                ("questions", index), f"repeats questions[{first_at[question]}]",
                "remove it: each question is a branch label, and labels must be unique",
            )
        first_at[question] = index


def _check_branch_list(branches: list[Branch], path: tuple, *, nested: bool) -> None:
    if not branches:
        where = "the branch list" if len(path) == 1 else "this children list"
        raise _Problem(path, f"{where} is empty", "add at least one branch with `label:` and `prompt:`")
    first_at: dict[str, int] = {}
    for index, branch in enumerate(branches):
        here = (*path, index)
        _check_label(branch.label, (*here, "label"))
        if branch.label in first_at:
            raise _Problem(
                (*here, "label"), f"'{branch.label}' repeats {format_path((*path, first_at[branch.label]))}.label",
                "rename one: labels name a branch's path (parent/child), so siblings need different labels",
            )
        first_at[branch.label] = index
        if not branch.prompt.strip():
            raise _Problem((*here, "prompt"), "is empty", "write the user-turn text for this branch")
        if nested and "children" in branch.model_fields_set:  # written out, even if empty
            _check_branch_list(branch.children, (*here, "children"), nested=True)


def _check_label(label: str, path: tuple) -> None:
    if not label.strip():
        raise _Problem(path, "is empty", "give the branch a short name")
    if "/" in label:
        raise _Problem(path, f"'{label}' contains '/'", "remove the '/': a child's path is shown as parent/child")


def template_sites(recipe: Recipe) -> Iterator[TemplateSite]:
    """Every text in the recipe that takes `$variables`: prompts, questions and the template."""
    if isinstance(recipe, AskManyRecipe) and recipe.questions is not None:
        for index, question in enumerate(recipe.questions):
            yield TemplateSite(("questions", index), question, "question")
        yield TemplateSite(("template",), recipe.template or ask_many_default_template(), "template")
    for index, branch in enumerate(getattr(recipe, "branches", None) or []):
        yield from _branch_sites(branch, ("branches", index), "root")
    if isinstance(recipe, BeamRecipe):
        if recipe.prompt is not None:
            yield TemplateSite(("prompt",), recipe.prompt, "root")
        if recipe.questions is not None:
            for index, question in enumerate(recipe.questions):
                yield TemplateSite(("questions", index), question, "question")
            yield TemplateSite(("template",), recipe.template or ask_many_default_template(), "template")
    if isinstance(recipe, MarginsRecipe):
        if recipe.query is not None:
            yield TemplateSite(("query",), recipe.query, "query")
        for index, question in enumerate(recipe.questions or []):
            yield TemplateSite(("questions", index), question, "query")
    if isinstance(recipe, ThinkRecipe):
        yield TemplateSite(("question",), recipe.question, "root")


def _branch_sites(branch: Branch, path: tuple, role: Literal["root", "child"]) -> Iterator[TemplateSite]:
    yield TemplateSite((*path, "prompt"), branch.prompt, role)
    for index, child in enumerate(branch.children):
        yield from _branch_sites(child, (*path, "children", index), "child")


def _check_template(site: TemplateSite, recipe: Recipe, var_names: set[str]) -> None:
    used = template_variables(site.text, site.path)
    where = format_path(site.path)
    for name in used:
        if name == "context" and recipe.context is None:
            raise _Problem(
                site.path, "uses $context, but the recipe has no context",
                "add `context: {input: true}` (or text: / file:), or remove $context",
            )
        if name == "context" and site.role == "question":
            raise _Problem(site.path, "a question cannot use $context", "put $context in `template:` instead")
        if name == "context" and site.role == "query":
            raise _Problem(site.path, "the query cannot use $context", "write the question itself; margins reads the context")
        if name == "question" and site.role != "template":
            raise _Problem(site.path, "$question is only filled in an ask-many template", "write the text itself here")
        if name not in RESERVED_VARIABLES and name not in recipe.vars and name not in var_names:
            raise _Problem(
                site.path, f"uses ${name}, which is not defined",
                f"add `{name}: <value>` under `vars:` or pass --var {name}=VALUE (or write $$ for a literal $)",
            )
    if site.role in ("root", "template") and recipe.context is not None and "context" not in used:
        raise _Problem(
            site.path, "does not use $context, so the context would be dropped",
            "put $context in it (first, so every branch shares the context's tokens)",
        )
    if site.role == "template" and "question" not in used:
        raise _Problem(site.path, "has no $question", f"add $question to the template ({where})")


def _check_vars_used(recipe: Recipe, sites: list[TemplateSite]) -> None:
    used = {name for site in sites for name in template_variables(site.text, site.path)}
    for name in recipe.vars:
        if name not in used:
            raise _Problem(("vars", name), f"no prompt uses ${name}", f"remove it, or use ${name} in a prompt")


_IDENTIFIER = re.compile(Template.idpattern, re.IGNORECASE)


def _is_identifier(name: str) -> bool:
    return bool(_IDENTIFIER.fullmatch(name))


def template_variables(text: str, path: tuple = ()) -> list[str]:
    """The `$names` a template uses, in order; a `$` that starts no name is a _Problem."""
    names: list[str] = []
    for match in Template.pattern.finditer(text):
        if match.group("invalid") is not None:
            column = match.start("invalid") + 1
            raise _Problem(
                path, f"has a $ that starts no variable name (character {column})",
                "write $$ for a literal dollar sign, or ${name} for a variable",
            )
        name = match.group("named") or match.group("braced")
        if name is not None and name not in names:
            names.append(name)
    return names


def fill(text: str, values: dict[str, str]) -> str:
    """Substitute the variables a (checked) template uses; `$$` becomes `$`."""
    return Template(text).substitute({name: values[name] for name in template_variables(text)})


# -- command-line layers -----------------------------------------------------------------------


def with_sampling(recipe: Recipe, overrides: Sampling) -> Recipe:
    """The recipe with `overrides` (flags given on the command line) winning everywhere: set at
    the top and cleared from every branch, so the result also reads right when saved."""
    given = {name: value for name, value in overrides.model_dump().items() if value is not None}
    if not given:
        return recipe
    copy = recipe.model_copy(deep=True)
    copy.sampling = copy.sampling.model_copy(update=given)
    for branch in _all_branches(getattr(copy, "branches", None) or []):
        if branch.sampling is not None:
            branch.sampling = branch.sampling.model_copy(update={name: None for name in given})
    return copy


_FLAG_NAMES = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
               "seed": "--seed", "max_new_tokens": "--max-new-tokens", "stop": "--stop"}


def sampling_from_flags(**flags: Any) -> Sampling:
    """Sampling from command-line values (None = not given), with flag names in any error.

    A repeatable flag that was not given arrives as an empty tuple: that is "not given" too."""
    stop = flags.get("stop")
    flags["stop"] = list(stop) if stop else None
    try:
        return Sampling(**flags)
    except ValidationError as error:
        first = error.errors()[0]
        flag = _FLAG_NAMES.get(str(first["loc"][0]), str(first["loc"][0]))
        bound = first["msg"].removeprefix("Input should be ")
        raise UsageError(f"{flag} {_short(first.get('input'))} is out of range (must be {bound})",
                         fix=_RANGE_FIXES.get(str(first["loc"][0]), "see mdcli --help")) from None


def _all_branches(branches: list[Branch]) -> Iterator[Branch]:
    for branch in branches:
        yield branch
        yield from _all_branches(branch.children)


def parse_vars(assignments: Iterable[str]) -> dict[str, str]:
    """`--var name=value` flags -> {name: value}."""
    values: dict[str, str] = {}
    for assignment in assignments:
        name, equals, value = assignment.partition("=")
        name = name.strip()
        if not equals or not _is_identifier(name):
            raise UsageError(
                f"--var '{assignment}' is not name=value", fix="write --var name=value, e.g. --var topic=cats"
            )
        if name in RESERVED_VARIABLES:
            raise UsageError(f"--var {name}: ${name} is filled by mdcli", fix="use --input for the context")
        values[name] = value
    return values


# -- compiling to branch specs ------------------------------------------------------------------


@dataclass(frozen=True)
class _Settings:
    """Fully resolved sampling for one branch."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()

    def then(self, layer: Sampling | None) -> _Settings:
        """These settings with a layer's stated fields on top."""
        if layer is None:
            return self
        given = {name: value for name, value in layer.model_dump().items() if value is not None}
        if "stop" in given:
            given["stop"] = tuple(given["stop"])
        return dataclasses.replace(self, **given)


def resolved_seed(recipe: Recipe) -> int | None:
    """The run's seed as reported in the Start event: the recipe-wide one."""
    return _Settings().then(recipe.sampling).seed


def compile_recipe(
    recipe: Recipe, tokenizer, *, input_text: str | None = None, vars: dict[str, str] | None = None
) -> list[BranchSpec]:
    """The recipe's root branch specs (children nested), tokenized as the engine will see them.

    Roots are whole prompts (prompts.prompt_token_ids: chat template, system, the context through
    $context); children are continuation turns after their parent's answer
    (prompts.continuation_token_ids). Raises RecipeError."""
    if not isinstance(recipe, (AskManyRecipe, TreeRecipe)):
        raise RecipeError(
            f"{recipe.source}: strategy: a {recipe.strategy} recipe has no branch list to compile",
            fix=f"run it with: mdcli run {recipe.source.removesuffix(' (built-in)').removesuffix('.yaml')}",
        )
    values, _ = _values_and_context(recipe, input_text, vars)
    base = _Settings().then(recipe.sampling)
    if isinstance(recipe, AskManyRecipe) and recipe.questions is not None:
        return _question_specs(recipe, tokenizer, values, base)
    return [_root_spec(branch, recipe, tokenizer, values, base) for branch in recipe.branches]


def recipe_events(
    recipe: Recipe, model, *, input_text: str | None = None, vars: dict[str, str] | None = None,
    max_forward_tokens: int = 1024, speculate: str | None = None,
) -> Iterator[Event]:
    """The events of running `recipe` (sampling overrides already applied with with_sampling):
    ask-many and tree compile to branch specs; beam, margins and think call their API function.
    Arguments are checked here, before the first event is asked for. Raises RecipeError/UsageError."""
    from mdcli import api

    speculation = _speculation(recipe, speculate)
    if isinstance(recipe, (AskManyRecipe, TreeRecipe)):
        specs = compile_recipe(recipe, model.tokenizer, input_text=input_text, vars=vars)
        return api.run_specs(
            model, specs, strategy=recipe.strategy, seed=resolved_seed(recipe), max_forward_tokens=max_forward_tokens,
            speculate=speculation,
        )
    values, context = _values_and_context(recipe, input_text, vars)
    settings = _Settings().then(recipe.sampling)
    if isinstance(recipe, BeamRecipe):
        return _beam_events(recipe, model, values, context, max_forward_tokens)
    if isinstance(recipe, MarginsRecipe):
        return _margins_events(recipe, model, values, context, settings, max_forward_tokens, speculation)
    if isinstance(recipe, ThinkRecipe):
        return api.think(
            model, fill(recipe.question, values), paths=recipe.paths, plan=recipe.plan, max_paths=recipe.max_paths,
            merge=recipe.merge, vote=recipe.vote, answer_pattern=recipe.answer_pattern,
            path_instructions=list(recipe.path_instructions),
            system=recipe.system, chat_template=recipe.chat_template, sampling=_sampling_params(settings),
            max_new_tokens=settings.max_new_tokens, plan_tokens=recipe.plan_tokens,
            conclusion_tokens=recipe.conclusion_tokens, stop=settings.stop, max_forward_tokens=max_forward_tokens,
            speculate=speculation,
        )
    raise UsageError(f"{recipe.source}: strategy {recipe.strategy} cannot run", fix="see docs/recipes.md")


def _speculation(recipe: Recipe, flag: str | None):
    """--speculate wins over the recipe's `speculate`; beam search keeps its own rules."""
    from mdcli.speculate import parse_speculate

    if isinstance(recipe, BeamRecipe):
        if flag is not None or recipe.speculate is not None:
            raise RecipeError(
                f"{recipe.source}: speculate: beam search does not speculate (its candidates are ranked across "
                "beams at every step)", fix="remove speculate from the recipe and --speculate from the command")
        return None
    return parse_speculate(flag if flag is not None else recipe.speculate)


def _sampling_params(settings: _Settings):
    from mdcli.sampling import SamplingParams

    return SamplingParams(
        temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
        min_p=settings.min_p, seed=settings.seed,
    )


def _beam_events(recipe: BeamRecipe, model, values: dict[str, str], context: str | None, max_forward_tokens: int):
    from mdcli import api

    options = {
        "width": recipe.width, "num_return": recipe.num_return, "length_penalty": recipe.length_penalty,
        "early_stopping": recipe.early_stopping, "max_new_tokens": recipe.sampling.max_new_tokens or 64,
        "system": recipe.system, "chat_template": recipe.chat_template, "max_forward_tokens": max_forward_tokens,
    }
    if recipe.questions is None:
        return api.beam_search(model, fill(recipe.prompt, values), **options)
    # the API's template is in ask-many form ($document, $question): fill the recipe's own
    # variables now (escaped, so a `$` in a value stays literal) and leave those two to the API
    escaped = {name: escape_dollars(value) for name, value in values.items()}
    template = fill(recipe.template or ask_many_default_template(),
                    {**escaped, "context": "$document", "question": "$question"})
    questions = [fill(question, values) for question in recipe.questions]
    return api.beam_search(model, context, questions, template=template, **options)


def _margins_events(
    recipe: MarginsRecipe, model, values, context: str, settings: _Settings, max_forward_tokens: int, speculation
):
    from mdcli.strategies.margins import run_margins

    job = _margins_job(recipe, values, context, settings)
    job.validate()  # here, before the first event is asked for
    return run_margins(model, job, max_forward_tokens=max_forward_tokens, speculate=speculation)


def margins_job(recipe: MarginsRecipe, *, input_text: str | None = None, vars: dict[str, str] | None = None):
    """The strategies.margins.Margins job a margins recipe runs (explain draws its margin phase)."""
    values, context = _values_and_context(recipe, input_text, vars)
    return _margins_job(recipe, values, context, _Settings().then(recipe.sampling))


def _margins_job(recipe: MarginsRecipe, values: dict[str, str], context: str, settings: _Settings):
    from mdcli.strategies.margins import Margins, MarginsPrompts

    overrides = {name: getattr(recipe, f"{name}_template") for name in ("margin", "classification", "answer")}
    prompts = MarginsPrompts(system=recipe.system, **{k: v for k, v in overrides.items() if v is not None})
    limits = {"segment_tokens": recipe.segment_tokens, "margin_tokens": recipe.sampling.max_new_tokens,
              "classify_tokens": recipe.classify_tokens, "answer_tokens": recipe.answer_tokens}
    return Margins(
        documents=[context], query=fill(recipe.query, values) if recipe.query is not None else "",
        questions=[fill(question, values) for question in recipe.questions or []], layout=recipe.layout,
        keep=recipe.keep, classify=recipe.classify, with_segments=recipe.with_segments, prompts=prompts,
        chat_template=recipe.chat_template, sampling=_sampling_params(settings),
        **{name: value for name, value in limits.items() if value is not None},
    )


def check_run_inputs(recipe: Recipe, *, input_text: str | None = None, vars: dict[str, str] | None = None) -> None:
    """What compile_recipe checks before it needs a tokenizer: variables and the context source.
    Commands call it before loading the model, so a missing --input fails in a blink."""
    _values_and_context(recipe, input_text, vars)


def _values_and_context(
    recipe: Recipe, input_text: str | None, vars: dict[str, str] | None
) -> tuple[dict[str, str], str | None]:
    """The recipe's variable values (with $context set when it has one) and its context text.
    Raises RecipeError naming the field."""
    try:
        values = _variable_values(recipe, vars or {})
        context = _context_text(recipe, input_text)
    except _Problem as problem:
        raise _error(recipe.source, problem.path, problem.problem, problem.fix) from None
    if context is not None:
        values["context"] = context
    return values, context


def _variable_values(recipe: Recipe, given: dict[str, str]) -> dict[str, str]:
    sites = list(template_sites(recipe))
    used = {name for site in sites for name in template_variables(site.text, site.path)}
    for name in given:
        if name not in used:
            known = ", ".join(sorted(used - set(RESERVED_VARIABLES))) or "none"
            raise _Problem((f"--var {name}",), f"no prompt uses ${name}", f"drop it; this recipe's variables: {known}")
    values = {name: value for name, value in recipe.vars.items() if value is not None}
    values.update(given)
    for site in sites:
        for name in template_variables(site.text):
            if name not in values and name not in RESERVED_VARIABLES:
                raise _Problem(site.path, f"uses ${name}, which has no value", f"pass --var {name}=VALUE")
    return values


def _context_text(recipe: Recipe, input_text: str | None) -> str | None:
    context = recipe.context
    takes_input = context is not None and bool(context.input)
    if input_text is not None and not takes_input:
        raise _Problem(
            ("context",), "this recipe does not read --input", "drop --input, or set `context: {input: true}`"
        )
    if context is None:
        return None
    if context.input:
        if input_text is None:
            raise _Problem(
                ("context", "input"), "the recipe reads its context from --input",
                "give --input FILE, or pipe text to stdin",
            )
        return input_text
    if context.text is not None:
        return context.text
    return _read_context_file(recipe.base_dir / context.file)


def _read_context_file(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except OSError as error:
        raise _Problem(
            ("context", "file"), f"cannot read {path}: {error.strerror}", "check the path and its permissions"
        ) from None
    except UnicodeDecodeError:
        raise _Problem(
            ("context", "file"), f"{path} is not UTF-8 text", "convert it, e.g. iconv -f latin1 -t utf-8"
        ) from None


def _question_specs(recipe: AskManyRecipe, tokenizer, values: dict[str, str], settings: _Settings) -> list[BranchSpec]:
    from mdcli.prompts import prompt_token_ids

    template = recipe.template or ask_many_default_template()
    specs = []
    for question in recipe.questions:
        label = fill(question, values)
        text = fill(template, {**values, "question": label})
        ids = prompt_token_ids(tokenizer, text, system=recipe.system, chat_template=recipe.chat_template)
        specs.append(_spec(label, ids, settings, []))
    return specs


def _root_spec(branch: Branch, recipe: Recipe, tokenizer, values: dict[str, str], parent: _Settings) -> BranchSpec:
    from mdcli.prompts import prompt_token_ids

    settings = parent.then(branch.sampling)
    text = fill(branch.prompt, values)
    ids = prompt_token_ids(tokenizer, text, system=recipe.system, chat_template=recipe.chat_template)
    children = [_child_spec(child, recipe, tokenizer, values, settings) for child in branch.children]
    return _spec(branch.label, ids, settings, children)


def _child_spec(branch: Branch, recipe: Recipe, tokenizer, values: dict[str, str], parent: _Settings) -> BranchSpec:
    """A follow-up inherits its parent's sampling, then applies its own overrides."""
    from mdcli.prompts import continuation_token_ids

    settings = parent.then(branch.sampling)
    ids = continuation_token_ids(tokenizer, fill(branch.prompt, values), chat_template=recipe.chat_template)
    children = [_child_spec(child, recipe, tokenizer, values, settings) for child in branch.children]
    return _spec(branch.label, ids, settings, children)


def _spec(label: str, ids: list[int], settings: _Settings, children: list[BranchSpec]) -> BranchSpec:
    from mdcli.decoding import BranchSpec
    from mdcli.sampling import SamplingParams

    params = SamplingParams(
        temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
        min_p=settings.min_p, seed=settings.seed,
    )
    return BranchSpec(
        label=label, prompt_ids=ids, sampling=params, max_new_tokens=settings.max_new_tokens,
        stop=settings.stop, children=children,
    )


# -- ask-many flags <-> recipes ------------------------------------------------------------------


def document_template_to_recipe(template: str) -> str:
    """An ask-many `--template` ($document, $question) in recipe form ($context, $question)."""

    def rename(match: re.Match) -> str:
        if match.group("named") == "document":
            return "$context"
        if match.group("braced") == "document":
            return "${context}"
        return match.group(0)

    return Template.pattern.sub(rename, template)


def ask_many_default_template() -> str:
    return document_template_to_recipe(ASK_MANY_DOCUMENT_TEMPLATE)


def escape_dollars(text: str) -> str:
    """Literal text (a question typed on the command line) as a template that fills to itself."""
    return text.replace("$", "$$")


def ask_many_recipe(
    base: AskManyRecipe | None,
    *,
    questions: list[str] | None = None,
    template: str | None = None,
    system: str | None = None,
    chat_template: bool | None = None,
    sampling: Sampling | None = None,
    source: str = "ask-many flags",
) -> AskManyRecipe:
    """The recipe equivalent to `mdcli ask-many` flags, on top of `base` (from --recipe) if any.

    None means "not given": the base's value stays. The document argument becomes
    `context: {input: true}`, so the recipe runs again with `mdcli run FILE --input DOC`.
    `template` is in ask-many form ($document); questions are literal text (`$` is escaped)."""
    data: dict[str, Any] = base.model_dump(exclude_none=True, exclude_defaults=True) if base else {}
    data.update(version=RECIPE_VERSION, strategy="ask-many", context={"input": True})
    data.setdefault("description", "Saved from mdcli ask-many.")
    if questions is not None:
        data["questions"] = [escape_dollars(question) for question in questions]
        data.pop("branches", None)
        _drop_vars_nothing_uses(data)
    if template is not None:
        data["template"] = document_template_to_recipe(template)
    if system is not None:
        data["system"] = system
    if chat_template is not None:
        data["chat_template"] = chat_template
    base_dir = base.base_dir if base else None
    recipe = validate_recipe_data(data, source=source, base_dir=base_dir)
    return with_sampling(recipe, sampling) if sampling is not None else recipe


def _drop_vars_nothing_uses(data: dict[str, Any]) -> None:
    """Questions from flags replace the recipe's: its variables for the old questions go too."""
    texts = [*data.get("questions", []), data.get("template") or ""]
    used = {name for text in texts for name in _names_or_none(text)}
    data["vars"] = {name: value for name, value in data.get("vars", {}).items() if name in used}


def _names_or_none(text: str) -> list[str]:
    try:
        return template_variables(text)
    except _Problem:
        return []


_KEY_ORDER = ("version", "description", "strategy", "context", "system", "chat_template", "vars", "sampling")


def dump_recipe(recipe: Recipe) -> str:
    """YAML for a recipe: the fields that differ from defaults, in a readable order."""
    data = recipe.model_dump(exclude_none=True, exclude_defaults=True)
    data["version"], data["strategy"] = recipe.version, recipe.strategy
    ordered = {key: data.pop(key) for key in _KEY_ORDER if key in data}
    ordered.update(data)
    return yaml.dump(ordered, Dumper=_RecipeDumper, sort_keys=False, allow_unicode=True, width=100)


class _RecipeDumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line text as a `|` block, as a person would."""


def _represent_text(dumper: yaml.SafeDumper, text: str):
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_RecipeDumper.add_representer(str, _represent_text)


# -- finding recipes -----------------------------------------------------------------------------


def builtin_names() -> list[str]:
    folder = resources.files(BUILTIN_PACKAGE)
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def builtin_text(name: str) -> str:
    return resources.files(BUILTIN_PACKAGE).joinpath(f"{name}.yaml").read_text(encoding="utf-8")


def read_recipe_source(name_or_path: str | Path) -> tuple[str, str, Path | None]:
    """(text, name for messages, folder that `context.file` is relative to) of a file or built-in."""
    shown = str(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return _read_recipe_file(path, shown), shown, path.resolve().parent
    name = shown.removesuffix(".yaml")
    if path.parent == Path(".") and name in builtin_names():
        folder = resources.files(BUILTIN_PACKAGE)
        base_dir = Path(str(folder)) if isinstance(folder, Path) else None
        return builtin_text(name), f"{name}.yaml (built-in)", base_dir
    if path.is_dir():
        raise RecipeError(f"{shown}: is a folder", fix="give a recipe file (.yaml)")
    raise RecipeError(
        f"{shown}: no such recipe file or built-in recipe",
        fix=f"check the path; built-in recipes: {', '.join(builtin_names())}",
    )


def _read_recipe_file(path: Path, shown: str) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except OSError as error:
        raise RecipeError(f"{shown}: cannot read it: {error.strerror}", fix="check its permissions") from None
    except UnicodeDecodeError as error:
        raise RecipeError(f"{shown}: not UTF-8 text (byte offset {error.start})", fix="save it as UTF-8") from None


def builtin_descriptions() -> list[tuple[str, str]]:
    """(name, one-line description) for `mdcli recipes list`."""
    rows = []
    for name in builtin_names():
        try:
            description = load_recipe(name).description or ""
        except RecipeError as error:
            description = f"(invalid: {error.problem})"
        rows.append((name, " ".join(description.split())))
    return rows
