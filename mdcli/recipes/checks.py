"""The rules a schema cannot state, common to every strategy, and the pieces strategies share.

check_recipe runs the common rules (the context, declared variables, every `$variable` defined
and every declared one used) around the strategy's own `recipe.check()`. Everything raises
errors.Problem (a field path, the problem, the fix); the loader names the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from mdcli.documents.inputs import Inputs, read_inputs
from mdcli.errors import UsageError
from mdcli.recipes.errors import Problem, format_path
from mdcli.recipes.schema import Branch, RecipeBase, TemplateSite
from mdcli.recipes.templates import RESERVED_VARIABLES, is_identifier, template_variables


def check_recipe(recipe: RecipeBase, var_names: set[str]) -> None:
    """Every rule beyond the schema. `var_names`: variables the command line will give (--var)."""
    _check_context(recipe)
    _check_declared_vars(recipe)
    recipe.check(var_names)
    sites = list(recipe.template_sites())
    for site in sites:
        _check_template(site, recipe, var_names)
    _check_vars_used(recipe, sites)


def _check_context(recipe: RecipeBase) -> None:
    context = recipe.context
    if context is None:
        return
    given = [name for name in ("text", "file", "files") if getattr(context, name) is not None]
    given += ["input"] if context.input else []
    if len(given) != 1:
        problem = "is empty" if not given else f"gives {' and '.join(given)}"
        raise Problem(
            ("context",), problem, "give exactly one of `text: ...`, `file: path`, `files: [paths]` or `input: true`"
        )
    if context.files is not None:
        context_documents(context.files, recipe.base_dir)  # every path and glob finds text, or a Problem
    if context.text is not None and not context.text.strip():
        raise Problem(("context", "text"), "is empty", "write the context text, or remove `context:`")
    if context.file is not None:
        path = recipe.base_dir / context.file
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            raise Problem(
                ("context", "file"), f"'{context.file}' {what} (looked for {path})",
                "give the path of a text file, relative to the recipe file",
            )


def context_documents(files: list[str], base_dir) -> Inputs:
    """`context: {files: [...]}` read: paths, folders and globs relative to the recipe's folder."""
    if not files:
        raise Problem(("context", "files"), "is an empty list", "name at least one file, folder or glob")
    try:
        return read_inputs(files, base=base_dir)
    except UsageError as error:
        raise Problem(("context", "files"), error.problem, error.fix or "check the paths") from None


def _check_declared_vars(recipe: RecipeBase) -> None:
    for name in recipe.vars:
        if not is_identifier(name):
            raise Problem(("vars", name), "is not a variable name", "use letters, digits and _ (not first a digit)")
        if name in RESERVED_VARIABLES:
            raise Problem(("vars", name), f"${name} is filled by mdcli", f"rename it; {name} cannot be set")


def _check_template(site: TemplateSite, recipe: RecipeBase, var_names: set[str]) -> None:
    used = template_variables(site.text, site.path)
    where = format_path(site.path)
    for name in used:
        if name == "context" and recipe.context is None:
            raise Problem(
                site.path, "uses $context, but the recipe has no context",
                "add `context: {input: true}` (or text: / file:), or remove $context",
            )
        if name == "context" and site.role == "question":
            raise Problem(site.path, "a question cannot use $context", "put $context in `template:` instead")
        if name == "context" and site.role == "query":
            raise Problem(site.path, "the query cannot use $context", "write the question itself; margins reads the context")
        if name == "question" and site.role != "template":
            raise Problem(site.path, "$question is only filled in an ask-many template", "write the text itself here")
        if name not in RESERVED_VARIABLES and name not in recipe.vars and name not in var_names:
            raise Problem(
                site.path, f"uses ${name}, which is not defined",
                f"add `{name}: <value>` under `vars:` or pass --var {name}=VALUE (or write $$ for a literal $)",
            )
    if site.role in ("root", "template") and recipe.context is not None and "context" not in used:
        raise Problem(
            site.path, "does not use $context, so the context would be dropped",
            "put $context in it (first, so every branch shares the context's tokens)",
        )
    if site.role == "template" and "question" not in used:
        raise Problem(site.path, "has no $question", f"add $question to the template ({where})")


def _check_vars_used(recipe: RecipeBase, sites: list[TemplateSite]) -> None:
    used = {name for site in sites for name in template_variables(site.text, site.path)}
    for name in recipe.vars:
        if name not in used:
            raise Problem(("vars", name), f"no prompt uses ${name}", f"remove it, or use ${name} in a prompt")


# -- pieces the strategies' checks share ------------------------------------------------------


def check_questions(questions: list[str]) -> None:
    """A `questions:` list: not empty, no empty or repeated question (each is a branch label)."""
    if not questions:
        raise Problem(("questions",), "the question list is empty", "add at least one question")
    first_at: dict[str, int] = {}
    for index, question in enumerate(questions):
        if not question.strip():
            raise Problem(("questions", index), "is empty", "write the question or remove it")
        if question in first_at:
            raise Problem(
                ("questions", index), f"repeats questions[{first_at[question]}]",
                "remove it: each question is a branch label, and labels must be unique",
            )
        first_at[question] = index


def check_branch_list(branches: list[Branch], path: tuple, *, nested: bool) -> None:
    """Labels unique among siblings and free of '/', prompts not empty; `nested`: children too."""
    if not branches:
        where = "the branch list" if len(path) == 1 else "this children list"
        raise Problem(path, f"{where} is empty", "add at least one branch with `label:` and `prompt:`")
    first_at: dict[str, int] = {}
    for index, branch in enumerate(branches):
        here = (*path, index)
        _check_label(branch.label, (*here, "label"))
        if branch.label in first_at:
            raise Problem(
                (*here, "label"), f"'{branch.label}' repeats {format_path((*path, first_at[branch.label]))}.label",
                "rename one: labels name a branch's path (parent/child), so siblings need different labels",
            )
        first_at[branch.label] = index
        if not branch.prompt.strip():
            raise Problem((*here, "prompt"), "is empty", "write the user-turn text for this branch")
        if nested and "children" in branch.model_fields_set:  # written out, even if empty
            check_branch_list(branch.children, (*here, "children"), nested=True)


def _check_label(label: str, path: tuple) -> None:
    if not label.strip():
        raise Problem(path, "is empty", "give the branch a short name")
    if "/" in label:
        raise Problem(path, f"'{label}' contains '/'", "remove the '/': a child's path is shown as parent/child")


def question_sites(questions: list[str] | None, template: str | None, default_template: str) -> Iterator[TemplateSite]:
    """Ask-many style questions and the template they are filled into."""
    if questions is None:
        return
    for index, question in enumerate(questions):
        yield TemplateSite(("questions", index), question, "question")
    yield TemplateSite(("template",), template or default_template, "template")


def branch_sites(branch: Branch, path: tuple, role: Literal["root", "child"] = "root") -> Iterator[TemplateSite]:
    """A branch's prompt and its children's, depth first."""
    yield TemplateSite((*path, "prompt"), branch.prompt, role)
    for index, child in enumerate(branch.children):
        yield from branch_sites(child, (*path, "children", index), "child")
