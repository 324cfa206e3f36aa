"""Job fields as the command line spells them.

Strategies name their jobs' fields in errors ("paths must be at least 1"); a command shows the
same error with its flags ("--paths must be at least 1"). A field is its flag with dashes
(`conclusion_tokens` is --conclusion-tokens) unless this table says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mdcli.errors import UsageError

FLAGS = {
    "margin_tokens": "--max-new-tokens",  # margins: -n is the margins' budget
    "layout": "--context",  # margins: chain | independent
    "path_instructions": "--path-instruction",  # think: repeatable, one per flag
    "questions": '-q "..." or --questions-file FILE',  # ask-many: where questions come from
    "query": "--question",  # margins: the question (--query, its old spelling, still works)
    "k": "--candidates",  # explore: candidates per kept path (--k, its old spelling, still works)
}


def flag(field: str) -> str:
    return FLAGS.get(field, "--" + field.replace("_", "-"))


@contextmanager
def in_flags() -> Iterator[None]:
    """Errors about job fields, raised inside, come out naming the command's flags."""
    try:
        yield
    except UsageError as error:
        spelled = getattr(error, "spelled", None)  # a strategies.job.FieldError
        if spelled is None:
            raise
        raise spelled(flag) from error
