"""Errors the user can act on.

Every error that reaches the command line is one line: what is wrong and how to fix it.
`exit_code` follows the Unix convention used throughout mdcli: 2 for usage and recipe
errors (the fix is in what the user typed), 1 for runtime failures.
"""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class MdcliError(Exception):
    """Base class: a problem with a message fit to show the user as is."""

    exit_code = 1

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.problem = message
        self.fix = fix
        super().__init__(message if fix is None else f"{message} ({fix})")

    def line(self) -> str:
        """The error as the command line prints it after "mdcli: error: ": "problem; fix". A
        problem that ends a sentence of its own (a library's message quoted in it) loses its
        period before the fix, so the line never reads ".;"."""
        if self.fix is None:
            return self.problem
        problem = self.problem.rstrip()
        if problem.endswith(".") and not problem.endswith(".."):
            problem = problem[:-1]
        return f"{problem}; {self.fix}"


class UsageError(MdcliError):
    """Bad input: an option, a file, a document, a question. Exit 2."""

    exit_code = 2


class RecipeError(UsageError):
    """A recipe file that cannot be run as written. Exit 2."""


class UnsupportedModelError(UsageError):
    """A model (or setting) that cannot give exact MultiDecode results. Exit 2."""


class ModelLoadError(MdcliError):
    """The model could not be loaded (missing files, no network, bad weights). Exit 1."""


class ContextTooLongError(UsageError):
    """A prompt that does not fit in the model's context window. Exit 2."""
