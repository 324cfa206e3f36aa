"""The command line: parse, validate, pick a renderer, consume the API's events. No model code.

torch and transformers are imported only inside commands that run a model, so `mdcli --help`
answers instantly.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from mdcli import __version__
from mdcli.cli.common import silence_stdout

app = typer.Typer(
    name="mdcli",
    help=(
        "Exact parallel decoding (MultiDecode): many branches of one model decode together over ONE "
        "shared KV cache, each getting exactly the tokens it would get alone."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mdcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """Exact parallel decoding (MultiDecode) over Hugging Face models."""


# -- commands: each lives in mdcli/cli/<name>.py -----------------------------------------

from mdcli.cli import ask_many  # noqa: E402
from mdcli.cli import beam  # noqa: E402
from mdcli.cli import margins  # noqa: E402
from mdcli.cli import think  # noqa: E402
from mdcli.cli import bench  # noqa: E402

app.command("ask-many")(ask_many.ask_many)
app.command("beam")(beam.beam)
app.command("margins")(margins.margins)
app.command("think")(think.think)
app.command("bench")(bench.bench)

from mdcli.cli import cache, explain, explore, info, recipes, run  # noqa: E402

app.command("run")(run.run)
app.command("explain")(explain.explain)
app.command("explore")(explore.explore)
app.command("info")(info.info)
app.add_typer(recipes.app, name="recipes")
app.add_typer(cache.app, name="cache")


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        silence_stdout()
        sys.exit(0)
    except KeyboardInterrupt:
        sys.exit(130)
