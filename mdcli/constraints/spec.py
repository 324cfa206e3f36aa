"""The `Constraint` model: what a branch's answer must look like, checked before any model loads.

Exactly one of:

* `choices`: the answer is exactly one of these strings;
* `regex`: the answer matches this regular expression in full (Rust `regex` syntax, as llguidance
  reads it: no look-around, no back-references);
* `schema`: the answer is one JSON document valid under this JSON Schema. Given as text, it is
  JSON, or llm's concise form: fields separated by commas (or newlines), each `name [type]
  [: description]`, type one of str (the default), int, float, bool, e.g. 'name, age int'.

Every check runs here, on the model alone: the grammar is compiled against a byte-level tokenizer
(256 one-byte tokens and an EOS), which needs no model and says whether the regex or schema is
valid, and whether it allows any non-empty answer at all.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import llguidance
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mdcli.errors import UsageError

_CONCISE_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


class ConstraintError(UsageError, ValueError):
    """A constraint that cannot be used: a usage error (exit 2, one line) when a Constraint is
    built directly; a ValueError inside validation, so a recipe reports it at its field's path
    (recipes/errors.py) and a job names its field (strategies/job.py)."""


class Constraint(BaseModel):
    """One output constraint (module docstring). Built directly, invalid input raises UsageError
    (exit 2) in one line; inside a job or recipe, the job's or recipe's error names the field."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as error:
            first = error.errors()[0]
            cause = first.get("ctx", {}).get("error")
            if isinstance(cause, ConstraintError):
                raise cause from None
            raise  # a key or type pydantic refused: a recipe or job names it in its own words

    choices: tuple[str, ...] | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_from_text(cls, value: Any) -> Any:
        return schema_from_text(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> Constraint:
        given = [name for name in ("choices", "regex", "schema") if self._value(name) is not None]
        if len(given) != 1:
            raise ConstraintError(
                "a constraint takes exactly one of choices, regex or schema" + (f" (got {', '.join(given)})" if given else ""),
                fix="keep one of them",
            )
        if self.choices is not None:
            if not self.choices:
                raise ConstraintError("the choice list is empty", fix="give at least one choice")
            if any(not choice for choice in self.choices):
                raise ConstraintError("a choice is empty", fix="give each choice some text")
        _probe(self.grammar(), self.kind, self._shown())
        return self

    def _value(self, name: str) -> Any:
        return self.json_schema if name == "schema" else getattr(self, name)

    @property
    def kind(self) -> str:
        """"choices" | "regex" | "schema"."""
        return "choices" if self.choices is not None else "regex" if self.regex is not None else "schema"

    def grammar(self) -> str:
        """The llguidance grammar of this constraint."""
        if self.choices is not None:
            # a Lark grammar of string literals: JSON's escapes are Lark's
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choices))
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        own = self.json_schema.get("x-guidance")
        own_layout = isinstance(own, dict) and any(key in own for key in ("whitespace_flexible", "whitespace_pattern"))
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(closed_schema(self.json_schema)),
                                                             defaults=None if own_layout else JSON_LAYOUT)

    def _shown(self) -> str:
        if self.choices is not None:
            return " | ".join(self.choices)
        if self.regex is not None:
            return self.regex
        return json.dumps(self.json_schema, separators=(",", ":"))

    def describe(self) -> str:
        """One short line: "choices: yes | no", "regex: \\d+", "schema: {...}" (long ones cut)."""
        shown = self._shown()
        return f"{self.kind}: {shown if len(shown) <= 80 else shown[:77] + '...'}"

    def recipe_value(self) -> dict[str, Any]:
        """The YAML form (`constraint:` in a recipe), which loads back to an equal model."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# How an answer under a schema is written: on one line, with no whitespace but the one space after
# each ',' and ':' (json.dumps' own layout). Unlimited whitespace let a small model pad an object
# with blank lines until -n cut it. A schema's own "x-guidance" options win; one that sets its own
# whitespace gets llguidance's layout with it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Where a JSON Schema keeps the schemas inside it: keyword -> how they are held.
_ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
               "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_schema(schema: Any) -> Any:
    """The schema as the grammar reads it: every object that lists `properties` and does not say
    `additionalProperties` (or `unevaluatedProperties`) gets `additionalProperties: false`, so an
    answer ends after the properties the schema names, as OpenAI's strict mode, llm and ollama
    users expect. An object schema without properties stays open (closed it could only be {}), and
    so do the members of an `allOf`, whose properties add up. The schema given is not changed."""
    return _closed(schema, close=True)


def _closed(schema: Any, close: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key], True)
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _closed(out["additionalProperties"], True)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(member, True) for member in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_closed(member, False) for member in out["allOf"]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(member, True) for name, member in out[key].items()}
    if close and isinstance(out.get("properties"), dict) and out["properties"] \
            and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def schema_from_text(text: str) -> dict[str, Any]:
    """A schema given as text: JSON (an object), else llm's concise form."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            schema = json.loads(stripped)
        except json.JSONDecodeError as error:
            raise ConstraintError(f"the schema is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}",
                             fix="fix the JSON, or use the concise form 'name, age int'") from None
        if not isinstance(schema, dict):
            raise ConstraintError("the schema is not a JSON object", fix="give a JSON Schema object")
        return schema
    return concise_schema(stripped)


def concise_schema(text: str) -> dict[str, Any]:
    """llm's concise schema: 'name, age int, bio: their story' -> a JSON Schema object with those
    properties, all required, no others."""
    fields = [part.strip() for part in (text.splitlines() if "\n" in text else text.split(","))]
    properties: dict[str, Any] = {}
    for field in filter(None, fields):
        head, _, description = field.partition(":")
        words = head.split()
        if not words or len(words) > 2 or not _NAME.match(words[0]) or (len(words) == 2 and words[1] not in _CONCISE_TYPES):
            raise ConstraintError(
                f"cannot read the schema field '{field}'",
                fix="write fields as 'name [str|int|float|bool][: description]', separated by commas, or give JSON",
            )
        spec: dict[str, Any] = {"type": _CONCISE_TYPES[words[1] if len(words) == 2 else "str"]}
        if description.strip():
            spec["description"] = description.strip()
        properties[words[0]] = spec
    if not properties:
        raise ConstraintError("the schema is empty", fix="give fields, e.g. 'name, age int', or a JSON Schema")
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


class _ByteTokenizer:
    """256 one-byte tokens and an EOS: a tokenizer for checking grammars without a model."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def _probe(grammar: str, kind: str, shown: str) -> None:
    """Refuse a grammar that does not compile, or that allows no non-empty answer."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        problem = matcher.get_error().strip().splitlines()
        details = [line.split("error:", 1)[1].strip() for line in problem if line.startswith("error:")]
        detail = details[0] if details else (problem[0] if problem else "")
        raise ConstraintError(f"the {kind} is invalid: {detail}", fix=_FIXES[kind])
    mask = matcher.compute_bitmask()
    if not any(mask[:32]):  # no byte can start an answer
        what = "only the empty answer" if matcher.is_accepting() else "nothing"
        raise ConstraintError(f"the {kind} '{shown[:60]}' matches {what}", fix=_FIXES[kind])


_FIXES = {
    "choices": "give the choices as plain strings",
    "regex": "check the pattern (Rust regex syntax: no look-around or back-references)",
    "schema": "give a valid JSON Schema object, or the concise form 'name, age int'",
}
