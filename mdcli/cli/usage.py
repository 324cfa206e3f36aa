"""How the command line presents itself: commands grouped by what they are for, a one-line
summary per command, examples at the top of each command's help, and usage errors in one line.

Click's own usage errors take three lines (usage, a hint, the error); mdcli prints every error as
one line `mdcli: error: PROBLEM; FIX` (exit 2), the same shape as the errors the commands raise.
"""

from __future__ import annotations

import inspect
import re
import sys

import typer
from typer.core import TyperGroup

# The top-level help lists commands in these groups, in this order.
SECTIONS: dict[str, tuple[str, ...]] = {
    "Ask": ("ask-many", "beam", "margins"),
    "Reason": ("think", "explore"),
    "Recipes": ("run", "explain", "recipes"),
    "Tools": ("info", "cache", "bench"),
}

# One line each for the top-level help (Click would cut the docstring's first sentence with "...").
SHORT_HELP: dict[str, str] = {
    "ask-many": "Many questions about one document, every answer decoding at once.",
    "beam": "Beam search as one tree in one cache (generate(num_beams=W)'s results).",
    "margins": "Writing in the Margins: a note per segment, then an answer per question.",
    "think": "Parallel chains of thought, then a conclusion or a vote.",
    "explore": "Step-level search: k sampled candidate steps, the best kept.",
    "run": "Run a recipe (a YAML file or a built-in name).",
    "explain": "Show how a recipe's branches share one cache, without running it.",
    "recipes": "List, show and check recipes.",
    "info": "This host, torch and transformers, and the kernel plan for a model.",
    "cache": "List or clear the prompt cache (documents prefilled before, on disk).",
    "bench": "Benchmark the forest against generate (per branch, batched).",
}

# Two or three examples at the top of each command's help; each fits an 80-column terminal.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "ask-many": (
        'mdcli ask-many story.txt -q "Who is the main character?" -q "Where?"',
        "mdcli ask-many report.txt --questions-file questions.txt -n 64",
        'mdcli ask-many story.txt -q "Who?" -q "When?" --json | jq .answers',
    ),
    "beam": (
        'mdcli beam "Translate to French: The cat sleeps." --width 4',
        'mdcli beam "Translate to French: Hello." -w 4 --num-return 3 -n 24',
        'mdcli beam story.txt -q "Who is the main character?" --width 3',
    ),
    "margins": (
        'mdcli margins report.txt -q "Which projects went over budget?"',
        'mdcli margins story.txt -q "Who?" -q "What boat?" -n 24',
        'mdcli margins a.txt b.txt -q "What changed?" --show-margins',
    ),
    "think": (
        'mdcli think "What is 17 + 25? End with Answer: N" --paths 3 --vote',
        'mdcli think "Plan a 3-day trip to Rome." --plan -n 96',
        'mdcli think "Is 91 prime?" --paths 3 --greedy',
    ),
    "explore": (
        'mdcli explore "Give two tips for sleeping well." -k 4 --seed 1',
        'mdcli explore "Explain rainbows." -k 3 --score judge -n 64',
    ),
    "run": (
        "mdcli recipes list",
        "mdcli run follow-ups --input story.txt",
        "mdcli run my-recipe.yaml --var topic=tides --jsonl",
    ),
    "explain": (
        "mdcli explain follow-ups --input story.txt",
        "mdcli explain follow-ups --input story.txt --tokens",
    ),
    "info": (
        "mdcli info",
        "mdcli info -m Qwen/Qwen2.5-0.5B-Instruct --json",
    ),
    "bench": (
        "mdcli bench --branches 1,8 --new-tokens 64",
    ),
}


def with_examples(name: str, doc: str | None) -> str:
    """`doc` with an Examples block after its first paragraph (kept unwrapped by Click's `\\b`)."""
    text = inspect.cleandoc(doc or "")
    examples = EXAMPLES.get(name)
    if not examples:
        return text
    first, _, rest = text.partition("\n\n")
    block = "\b\nExamples:\n" + "\n".join(f"  {example}" for example in examples)
    return f"{first}\n\n{block}" + (f"\n\n{rest}" if rest else "")


# -- usage errors in one line ---------------------------------------------------------------------

# Options a user reaches for that a command spells otherwise: (command, what was typed) -> the fix.
HINTS: dict[tuple[str, str], str] = {
    ("think", "-k"): "think's number of paths is --paths (-k is explore's candidates per step)",
}


def _is(error: BaseException, kind: str) -> bool:
    """Click's exceptions by name: typer ships its own copy of Click (typer._click), whose classes
    are not importable from any public module, so `except click.UsageError` would not match them."""
    return any(cls.__name__ == kind for cls in type(error).__mro__)


def one_line(error) -> str:
    """Click's usage error as mdcli's one line: the problem, then how to fix it."""
    message = " ".join(error.format_message().split()).rstrip(".")
    context = error.ctx
    command = context.command.name if context is not None and context.command is not None else None
    path = context.command_path if context is not None else "mdcli"
    if _is(error, "NoSuchOption") and (command, error.option_name) in HINTS:
        return f"{message}; {HINTS[(command, error.option_name)]}"
    if message.startswith("Got unexpected extra argument") and _takes_questions(context):
        extra = re.search(r"argument\(?s?\)? \((.*)\)$", message)
        question = extra.group(1) if extra else "..."
        return f"{message}; a question goes after -q: {_program(path)} FILE -q \"{question}\""
    return f"{message}; see '{_program(path)} --help'"


def _takes_questions(context) -> bool:
    if context is None or context.command is None:
        return False
    return any("-q" in getattr(param, "opts", ()) for param in context.command.params)


def _program(path: str) -> str:
    """`python -m mdcli think` is named as the user would type it again: `mdcli think`."""
    words = path.split()
    named = [i for i, word in enumerate(words) if word == "mdcli" or word.endswith(("/mdcli", "-mdcli"))]
    return " ".join(["mdcli", *words[(named[0] + 1 if named else 1):]])


class MdcliGroup(TyperGroup):
    """The top-level command: sections in its help, one-line usage errors."""

    def list_commands(self, ctx) -> list[str]:
        ordered = [name for names in SECTIONS.values() for name in names]
        known = super().list_commands(ctx)
        return [name for name in ordered if name in known] + [name for name in known if name not in ordered]

    def format_commands(self, ctx, formatter) -> None:
        commands = {name: self.get_command(ctx, name) for name in self.list_commands(ctx)}
        placed = {name for names in SECTIONS.values() for name in names}
        sections = {**SECTIONS, "Other": tuple(name for name in commands if name not in placed)}
        for title, names in sections.items():
            rows = [(name, commands[name].get_short_help_str()) for name in names
                    if commands.get(name) is not None and not commands[name].hidden]
            if rows:
                with formatter.section(f"{title} commands"):
                    formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            print("mdcli: error: aborted", file=sys.stderr)
            sys.exit(1)
        except Exception as error:
            if _is(error, "NoArgsIsHelpError"):  # `mdcli` alone: the help, as Click shows it
                print(error.format_message(), file=sys.stderr)
                sys.exit(2)
            if _is(error, "UsageError"):
                print(f"mdcli: error: {one_line(error)}", file=sys.stderr)
                sys.exit(2)
            if _is(error, "ClickException"):
                print(f"mdcli: error: {' '.join(error.format_message().split())}", file=sys.stderr)
                sys.exit(error.exit_code)
            raise
        sys.exit(code if isinstance(code, int) else 0)
