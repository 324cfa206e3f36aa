"""Shared options are declared once, as option groups (mdcli/cli/groups.py, mdcli/cli/options.py).

A new shared option is one field of one dataclass: every command that takes the group shows it
in --help and gets its value in the group object. The commands' own signatures list only their
own options, and no command reads its locals.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Annotated

import typer
from typer.testing import CliRunner

from mdcli.cli.app import app
from mdcli.cli.groups import UNSET, Group, offered, takes
from mdcli.cli.options import DecodeFlags, LoadFlags, OutputFlags

runner = CliRunner()
CLI = Path(__file__).resolve().parent.parent / "mdcli" / "cli"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A fixture's group: one shared option."""

    size: Annotated[int, typer.Option("--size", help="How big.")] = 3


def tiny_app(group: type) -> tuple[typer.Typer, list]:
    """Two commands taking `group` (one offering part of it), each recording the object it got."""
    seen: list = []
    tiny = typer.Typer()

    @tiny.command("draw")
    @takes(shape=group)
    def draw(name: Annotated[str, typer.Argument()], *, shape) -> None:
        seen.append(("draw", name, shape))

    @tiny.command("fill")
    @takes(shape=Group(group).without("size"))
    def fill(colour: Annotated[str, typer.Option("--colour")] = "red", *, shape) -> None:
        seen.append(("fill", colour, shape))

    return tiny, seen


def test_a_new_shared_option_is_one_field_and_every_command_of_its_group_shows_and_gets_it():
    # the one edit: a field added to the group's dataclass
    @dataclasses.dataclass(frozen=True)
    class ShapeWithEdges(Shape):
        edges: Annotated[int, typer.Option("--edges", help="How many edges.")] = 4

    tiny, seen = tiny_app(ShapeWithEdges)
    assert "--edges" in runner.invoke(tiny, ["draw", "--help"]).stdout
    assert "--edges" in runner.invoke(tiny, ["fill", "--help"]).stdout
    assert "--size" not in runner.invoke(tiny, ["fill", "--help"]).stdout  # fill offers the group without it

    assert runner.invoke(tiny, ["draw", "box", "--edges", "6", "--size", "2"]).exit_code == 0
    assert runner.invoke(tiny, ["fill", "--edges", "5"]).exit_code == 0
    (_, name, drawn), (_, colour, filled) = seen
    assert (name, drawn) == ("box", ShapeWithEdges(size=2, edges=6))
    assert (colour, filled.edges, filled.size) == ("red", 5, UNSET)  # a field not offered is UNSET
    assert offered(filled) == {"edges": 5}


def test_a_command_may_give_a_field_its_own_option_and_default_and_the_group_gets_its_value():
    seen: list = []
    tiny = typer.Typer()

    @tiny.command()
    @takes(shape=Group(Shape).defaults(size=9))
    def one(*, shape) -> None:
        seen.append(shape.size)

    @tiny.command()
    @takes(shape=Shape)
    def two(size: Annotated[int, typer.Option("--size", "-s", help="Its own words.")] = 1, *, shape) -> None:
        seen.append((size, shape.size))

    assert runner.invoke(tiny, ["one"]).exit_code == 0
    assert runner.invoke(tiny, ["two", "-s", "7"]).exit_code == 0
    assert "Its own words." in runner.invoke(tiny, ["two", "--help"]).stdout
    assert seen == [9, (7, 7)]


def test_the_commands_that_take_a_whole_group_offer_every_field_of_it():
    commands = typer.main.get_command(app).commands
    everything = {field.name for group in (LoadFlags, DecodeFlags, OutputFlags) for field in dataclasses.fields(group)}
    for name in ("ask-many", "think", "run"):
        assert everything <= {param.name for param in commands[name].params}, name


def test_the_commands_signatures_list_only_their_own_options_and_none_reads_its_locals():
    shared = {field.name for group in (LoadFlags, DecodeFlags, OutputFlags) for field in dataclasses.fields(group)}
    for path in sorted(CLI.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        calls = [node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
        assert "locals" not in calls, path.name
    from mdcli.cli import ask_many, beam, explore, margins, run, think

    for command in (ask_many.ask_many, beam.beam, margins.margins, think.think, explore.explore, run.run):
        own = inspect.signature(inspect.unwrap(command)).parameters
        # a shared option a command declares itself is a variant of it (its own help, default or type)
        variants = {"max_new_tokens", "temperature", "output"} & set(own)
        assert not (set(own) & shared) - variants, command.__name__
