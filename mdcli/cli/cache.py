"""`mdcli cache list | clear`: the prompt cache's entries (see docs/commands.md#mdcli-cache)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from mdcli.cli.common import command_group, errors
from mdcli.cli.options import DebugOpt

app = command_group("cache", "The prompt cache: the keys and values of documents prefilled before, kept on disk.")

FolderOpt = Annotated[
    str,
    typer.Option("--prompt-cache", help="auto (mdcli's cache folder, MDCLI_PROMPT_CACHE_DIR) or the folder given "
                 "to --prompt-cache DIR."),
]


@app.command("list")
def list_entries(
    prompt_cache: FolderOpt = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per entry, one a line.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Each entry: model, tokens, size, age (since last used) and first words; most recent first."""
    with errors(debug):
        from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

        folder, entries = api.prompt_cache_entries(prompt_cache)
        if as_json:
            for entry in entries:
                typer.echo(json.dumps(entry.as_dict()))
            return
        if folder is None:
            typer.echo("the prompt cache is off", err=True)
            return
        rows = [("model", "tokens", "size", "age", "first words")]
        rows += [(e.model, f"{e.tokens:,}", _size(e.bytes), _age(e.age_seconds),
                  e.first_words if e.problem is None else f"(bad: {e.problem})") for e in entries]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for row in rows if entries else []:  # an empty cache prints no table, only the count below
            typer.echo("  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:4], widths[1:])),
                                  row[4]]).rstrip())
        total = sum(e.bytes for e in entries)
        typer.echo(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {_size(total)} in {folder}", err=True)


@app.command("clear")
def clear(
    prompt_cache: FolderOpt = "auto",
    older_than: Annotated[
        Optional[str],
        typer.Option("--older-than", help="Only entries unused for longer than this: 90s, 30m, 12h, 7d, 2w.",
                     show_default=False),
    ] = None,
    debug: DebugOpt = False,
) -> None:
    """Remove the prompt cache's entries (all, or those unused for longer than --older-than)."""
    with errors(debug):
        from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

        folder, removed, freed = api.clear_prompt_cache(prompt_cache, older_than)
        if folder is None:
            typer.echo("the prompt cache is off: nothing to clear", err=True)
            return
        typer.echo(f"removed {removed} entr{'y' if removed == 1 else 'ies'} ({_size(freed)}) from {folder}", err=True)


def _size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _age(seconds: float) -> str:
    for unit, scale in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.0f}{unit}"
    return f"{seconds:.0f}s"
