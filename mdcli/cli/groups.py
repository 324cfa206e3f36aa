"""Option groups: shared options declared once, as the fields of a dataclass.

Typer has no option groups, so this module makes them. A group is a dataclass whose fields are
Typer options (`Annotated[type, typer.Option(...)]` with defaults): `LoadFlags`, `DecodeFlags`
and `OutputFlags` in mdcli/cli/options.py. A command names the groups it takes with `takes`, and
a parameter for each; its signature lists only its own options:

    @takes(load=LOAD, decode=DECODE.without("stop"), out=OUTPUT)
    def explore(prompt: PromptArg, k: KOpt = 4, *, load: LoadFlags, decode: DecodeFlags, out: OutputFlags):

`takes` puts every offered field of each group into the signature Typer reads (after the
command's own options, group by group, in field order: the order --help shows), and at call time builds each group
object from those values and hands it to the command. So a new shared option is one field in
one dataclass, and every command that takes the group shows it in --help and gets it.

A command may offer part of a group (`only`, `without`), give a field another default
(`defaults`), or declare a field as its own option (another help, another type): its own option
then stands in the group's place in the signature, and its value fills the field too. A field the command
does not offer holds `UNSET`; `offered(group)` is what it does offer.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar, get_type_hints

F = TypeVar("F", bound=Callable[..., Any])


class _Unset:
    """A field that the command does not offer: its value is the API's default, not the flag's."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class Group:
    """A group's dataclass and what a command offers of it: some or all of its fields, maybe with
    other defaults."""

    cls: type
    names: tuple[str, ...] | None = None  # None: every field
    changed: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def fields(self) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(self.cls))

    def offered(self) -> tuple[str, ...]:
        return self.fields() if self.names is None else self.names

    def only(self, *names: str) -> Group:
        self._known(names)
        return dataclasses.replace(self, names=tuple(name for name in self.fields() if name in names))

    def without(self, *names: str) -> Group:
        self._known(names)
        return dataclasses.replace(self, names=tuple(name for name in self.offered() if name not in names))

    def defaults(self, **values: Any) -> Group:
        self._known(values)
        return dataclasses.replace(self, changed=MappingProxyType({**self.changed, **values}))

    def parameters(self) -> list[inspect.Parameter]:
        """The offered fields as keyword parameters, annotated with their Typer options."""
        hints = _field_hints(self.cls)
        defaults = {field.name: field.default for field in dataclasses.fields(self.cls)}
        return [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[name],
                              default=self.changed.get(name, defaults[name]))
            for name in self.offered()
        ]

    def build(self, values: Mapping[str, Any]) -> Any:
        """The group object: each field its value in `values`, else UNSET."""
        return self.cls(**{name: values.get(name, UNSET) for name in self.fields()})

    def _known(self, names: Iterable[str]) -> None:
        unknown = sorted(set(names) - set(self.fields()))
        if unknown:
            raise TypeError(f"{self.cls.__name__} has no field {', '.join(unknown)}")


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    """A group's field annotations, each its Typer option: evaluated once per group, not once per command
    that takes it (each command's import paid about 0.5 ms for the evaluations)."""
    return get_type_hints(cls, include_extras=True)


def offered(group_object: Any) -> dict[str, Any]:
    """The fields of a group object that its command offers (every field but the UNSET ones)."""
    return {field.name: value for field in dataclasses.fields(group_object)
            if (value := getattr(group_object, field.name)) is not UNSET}


def takes(**groups: Group | type) -> Callable[[F], F]:
    """The command takes these groups: `name=Group` (or the dataclass itself, every field), each
    handed to the command as its keyword parameter `name`."""
    chosen = {name: group if isinstance(group, Group) else Group(group) for name, group in groups.items()}

    def decorate(function: F) -> F:
        hints = get_type_hints(function, include_extras=True)
        own = {name: parameter.replace(annotation=hints.get(name, parameter.annotation))
               for name, parameter in inspect.signature(function).parameters.items() if name not in chosen}
        own_names = set(own)
        shared: list[inspect.Parameter] = []
        for group in chosen.values():  # a field the command declares itself stands where the group's would
            offered = {parameter.name: parameter for parameter in group.parameters()}
            for name in group.fields():
                if name in own:
                    shared.append(own.pop(name).replace(kind=inspect.Parameter.KEYWORD_ONLY))
                elif name in offered:
                    shared.append(offered[name])
        names = [parameter.name for parameter in [*own.values(), *shared]]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise TypeError(f"{function.__name__}: options offered twice: {', '.join(twice)}")
        fields = {name: set(group.fields()) for name, group in chosen.items()}

        @functools.wraps(function)
        def command(**values: Any) -> Any:
            arguments = {name: value for name, value in values.items() if name in own_names}
            for name, group in chosen.items():
                arguments[name] = group.build({k: v for k, v in values.items() if k in fields[name]})
            return function(**arguments)

        signature = inspect.Signature([*own.values(), *shared])
        command.__signature__ = signature  # type: ignore[attr-defined]  # what Typer reads
        command.__annotations__ = {parameter.name: parameter.annotation for parameter in signature.parameters.values()}
        return command  # type: ignore[return-value]

    return decorate
