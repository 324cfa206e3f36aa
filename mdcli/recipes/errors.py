"""Recipe problems in words: every one becomes ONE line, `<file>: <field path>: <problem>; <fix>`.

The code that finds a problem knows the field path but not the file, so it raises a Problem; the
loader, which knows the file, turns it into a RecipeError (exit 2). A pydantic error is put in
recipe words here too: the reader has to find the spot in their file and know what to type there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from mdcli.errors import RecipeError

if TYPE_CHECKING:
    from mdcli.recipes.schema import RecipeBase


@dataclass
class Problem(Exception):
    """A problem at a field path, before the file name is known to the code that finds it."""

    path: tuple
    problem: str
    fix: str


def recipe_error(source: str, path: tuple | str, problem: str, fix: str) -> RecipeError:
    where = path if isinstance(path, str) else format_path(path)
    return RecipeError(one_line(f"{source}: {where}: {problem}"), fix=one_line(fix))


def format_path(path: Iterable) -> str:
    """("branches", 1, "children", 0, "prompt") -> "branches[1].children[0].prompt"."""
    text = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text or "(top level)"


def one_line(text: str) -> str:
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= 400 else text[:400] + "…"


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def yaml_kind(value: Any) -> str:
    """What a YAML value is, as its writer would say it."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"the number {short(value)}"
    if isinstance(value, str):
        return f"the text {short(value)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


# -- schema errors in words --------------------------------------------------------------------

# the fix for a number out of range, by field name; a strategy's model adds its own (field_fixes)
RANGE_FIXES = {
    "temperature": "use 0 for greedy decoding or a positive number",
    "top_p": "use a number in (0, 1]; 1 turns it off",
    "top_k": "use 0 (off) or a positive whole number",
    "min_p": "use a number in [0, 1); 0 turns it off",
    "max_new_tokens": "use a whole number of at least 1",
}
_FIELD_HINTS = {
    "label": "`label: a-short-name`",
    "prompt": "`prompt: <the user-turn text>`",
    "branches": "`branches:` with a list of branches (each with label and prompt)",
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
_RANGE_KINDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number")


def problem_from_pydantic(error: dict, data: dict, models: Sequence[type[RecipeBase]]) -> Problem:
    """One pydantic error -> a problem in recipe words, with the discriminator tag dropped from the
    path. `models` are the strategies' recipe models (for "unknown strategy" and "that key belongs
    to strategy X")."""
    kind, loc, given = error["type"], tuple(error["loc"]), error.get("input")
    strategy = data.get("strategy")
    if loc and loc[0] == strategy:
        loc = loc[1:]
    names = [model.strategy_name() for model in models]
    if kind == "union_tag_invalid":
        return Problem(("strategy",), f"unknown strategy {short(strategy)}", f"use one of: {', '.join(names)}")
    if kind == "union_tag_not_found":
        return Problem(("strategy",), "missing", f"add `strategy:` with one of: {', '.join(names)}")
    if kind == "missing":
        field = loc[-1] if loc else ""
        hints = {**_FIELD_HINTS, "strategy": f"`strategy: {names[0]}` (or {', '.join(names[1:])})"}
        return Problem(loc, "missing required field", f"add {hints.get(field, f'`{field}:`')}")
    if kind == "extra_forbidden":
        return _unknown_key_problem(loc, strategy, models)
    if kind in _TYPE_WORDS:
        return Problem(loc, f"expected {_TYPE_WORDS[kind]}, got {yaml_kind(given)}", _type_fix(kind, given))
    if kind in _RANGE_KINDS:
        field = next((part for part in reversed(loc) if isinstance(part, str)), "")
        model = _model_named(strategy, models)
        fixes = {**RANGE_FIXES, **(model.field_fixes if model is not None else {})}
        return Problem(loc, f"{short(given)} is out of range (must be {bound(error)})", fixes.get(field, "fix the value"))
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return Problem(loc, f"{short(given)} is not allowed", f"use {expected}")
    if kind == "invalid_key":
        key_path = (*loc[:-1], str(loc[-1])) if loc else loc  # a mapping key, not a list index
        return Problem(key_path, f"the key {short(given)} is not text", "write mapping keys as names")
    cause = error.get("ctx", {}).get("error")
    if kind == "value_error" and hasattr(cause, "problem") and hasattr(cause, "fix"):  # e.g. a ConstraintError
        return Problem(loc, cause.problem, cause.fix)
    if kind == "recursion_loop":
        return Problem(loc, "this part contains itself (a cycle)", "write the branches out instead of aliasing")
    return Problem(loc, error["msg"], "see docs/recipes.md for the recipe format")


def bound(error: dict) -> str:
    """"greater than or equal to 0" from pydantic's "Input should be greater than or equal to 0"."""
    return error["msg"].removeprefix("Input should be ")


def _unknown_key_problem(loc: tuple, strategy: Any, models: Sequence[type[RecipeBase]]) -> Problem:
    key = loc[-1] if loc else "?"
    parent = loc[:-1]
    if not parent:
        owners = [m.strategy_name() for m in models if key in m.model_fields and m.strategy_name() != strategy]
        if owners:
            return Problem(
                loc, f"'{key}' is a setting of strategy {' / '.join(owners)}, not {strategy}",
                f"remove it, or set `strategy: {owners[0]}`",
            )
    allowed = _allowed_keys(_model_named(strategy, models), parent)
    fix = f"remove it or fix its spelling; allowed here: {', '.join(allowed)}" if allowed else "remove it"
    return Problem(loc, f"unknown key {short(key)}", fix)


def _model_named(strategy: Any, models: Sequence[type[RecipeBase]]) -> type[RecipeBase] | None:
    return next((model for model in models if model.strategy_name() == strategy), None)


def _allowed_keys(model: Any, path: tuple) -> list[str]:
    """The keys the schema accepts at `path` below `model` (for "did you mean" help)."""
    for part in path:
        if model is None:
            return []
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field else None
    # a key is written as its alias where it has one (a constraint's `schema`)
    return [field.alias or name for name, field in model.model_fields.items()] if model is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside `Optional[list[Model]]` and the like."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


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
