"""Environment switches set for a block of code and given back after (what they were, or unset)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def temporarily_set(name: str, value: str) -> Iterator[None]:
    """os.environ[name] = value inside the block; the previous value (or none) restored after."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
