"""Recipe files: reading YAML safely, finding built-in recipes, and writing a recipe back as YAML.

A recipe is data, never code: it is parsed by PyYAML's SafeLoader (so `!!python/...` tags are
refused), with two more refusals: a key written twice in a mapping, and a part that contains
itself through a YAML alias (a cycle).
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from mdcli.errors import RecipeError
from mdcli.recipes.errors import Problem, recipe_error, short, yaml_kind
from mdcli.recipes.schema import RECIPE_VERSION, RecipeBase

BUILTIN_PACKAGE = "mdcli.recipes.builtin"


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
        raise recipe_error(source, "(file)", f"invalid YAML: {error}", "check the file is a YAML mapping") from None
    except RecursionError:
        raise recipe_error(source, "(file)", "invalid YAML: nested too deeply", "flatten the document") from None


def _yaml_error(error: yaml.MarkedYAMLError, source: str) -> RecipeError:
    mark = error.problem_mark or error.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
    problem = error.problem or str(error)
    tag = re.search(r"tag '([^']*)'", problem)
    if isinstance(error, yaml.constructor.ConstructorError) and tag:
        shown = tag.group(1).replace("tag:yaml.org,2002:", "!!")
        return recipe_error(
            source, where, f"the tag {shown} is not allowed",
            "remove it: a recipe is plain YAML data (text, numbers, lists, mappings), never code",
        )
    if "appears twice" in problem:
        return recipe_error(source, where, problem, "keep one of them")
    return recipe_error(source, where, f"invalid YAML: {problem}", "check the indentation and quoting on that line")


def check_shape(data: Any) -> None:
    """What must hold before the schema can say anything useful: a mapping, version 1, no cycles."""
    if not isinstance(data, dict):
        kind = "an empty file" if data is None else yaml_kind(data)
        raise Problem((), f"a recipe is a YAML mapping, got {kind}", "start the file with `version: 1`")
    if "version" not in data:
        raise Problem(("version",), "missing", f"add `version: {RECIPE_VERSION}` at the top")
    if data["version"] != RECIPE_VERSION or isinstance(data["version"], bool):
        raise Problem(
            ("version",), f"unsupported version {short(data['version'])}",
            f"this mdcli reads `version: {RECIPE_VERSION}` recipes",
        )
    cycle = _find_cycle(data)
    if cycle is not None:
        raise Problem(
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


# -- writing YAML --------------------------------------------------------------------------------

_KEY_ORDER = ("version", "description", "strategy", "context", "system", "chat_template", "vars", "sampling")


def dump_recipe(recipe: RecipeBase) -> str:
    """YAML for a recipe: the fields that differ from defaults (of `sampling:` layers, the
    settings they state), in a readable order."""
    data = recipe.model_dump(exclude_none=True, exclude_defaults=True, by_alias=True, mode="json")
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
