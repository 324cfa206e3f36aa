"""`$variables` in recipe text: finding them, filling them, and the ask-many template in recipe form.

Recipe text is a string.Template: `$name` or `${name}` is a variable, `$$` a literal dollar sign.
`$context` (the recipe's context) and `$question` (in an ask-many template) are filled by mdcli.
"""

from __future__ import annotations

import re
from string import Template

from mdcli.recipes.errors import Problem
from mdcli.strategies.ask_many import DEFAULT_TEMPLATE as ASK_MANY_DOCUMENT_TEMPLATE

RESERVED_VARIABLES = ("context", "question")

_IDENTIFIER = re.compile(Template.idpattern, re.IGNORECASE)


def is_identifier(name: str) -> bool:
    return bool(_IDENTIFIER.fullmatch(name))


def template_variables(text: str, path: tuple = ()) -> list[str]:
    """The `$names` a template uses, in order; a `$` that starts no name is a Problem."""
    names: list[str] = []
    for match in Template.pattern.finditer(text):
        if match.group("invalid") is not None:
            column = match.start("invalid") + 1
            raise Problem(
                path, f"has a $ that starts no variable name (character {column})",
                "write $$ for a literal dollar sign, or ${name} for a variable",
            )
        name = match.group("named") or match.group("braced")
        if name is not None and name not in names:
            names.append(name)
    return names


def names_or_none(text: str) -> list[str]:
    """template_variables, or no names for text that is not a valid template."""
    try:
        return template_variables(text)
    except Problem:
        return []


def fill(text: str, values: dict[str, str]) -> str:
    """Substitute the variables a (checked) template uses; `$$` becomes `$`."""
    return Template(text).substitute({name: values[name] for name in template_variables(text)})


def escape_dollars(text: str) -> str:
    """Literal text (a question typed on the command line) as a template that fills to itself."""
    return text.replace("$", "$$")


def document_template_to_recipe(template: str) -> str:
    """An ask-many `--template` ($document, $question) in recipe form ($context, $question)."""
    def rename(match: re.Match) -> str:
        if match.group("named") == "document":
            return "$context"
        if match.group("braced") == "document":
            return "${context}"
        return match.group(0)

    return Template.pattern.sub(rename, template)


def recipe_template_to_document(template: str, values: dict[str, str]) -> str:
    """An ask-many recipe template ($context, $question, `$name` variables) as an ask-many job's
    `--template` ($document, $question), the variables filled in (their dollars kept literal): the
    inverse of document_template_to_recipe, filling to the same text."""
    def rename(match: re.Match) -> str:
        name = match.group("named") or match.group("braced")
        if name == "context":
            return "$document" if match.group("named") else "${document}"
        if name is None or name == "question":
            return match.group(0)
        return escape_dollars(values[name])

    return Template.pattern.sub(rename, template)


def ask_many_default_template() -> str:
    return document_template_to_recipe(ASK_MANY_DOCUMENT_TEMPLATE)
