#!/usr/bin/env python3
"""How often margins' classification reads as a valid label, without and with the constraint.

    python benchmarks/margins_labels.py examples/story.txt README.md docs/how-it-works.md

For every document and question below, margins runs twice on the embedded model (greedy, default
settings, one thread): with the classifier free (`classify_constraint=False`, the reply parsed
afterwards by `parse_verdict`) and under CLASSIFICATION_CONSTRAINT (the default). Counted: the
classification notes whose reply parsed to YES or NO, and how many said relevant.
"""

from __future__ import annotations

import sys

import torch

from mdcli import api
from mdcli.events import Note

QUESTIONS = ["Who is the main character?", "How is the cache shared between branches?"]


def main(paths: list[str]) -> None:
    torch.set_num_threads(1)
    lm = api.load_model(quiet=True)
    for constrained in (False, True):
        parsed = relevant = total = 0
        for path in paths:
            text = open(path, encoding="utf-8").read()
            for question in QUESTIONS:
                job = api.Margins(documents=[text], query=question, classify_constraint=constrained)
                for event in api.margins(lm, job):
                    if isinstance(event, Note) and event.kind == "classification":
                        total += 1
                        parsed += event.data["parsed"]
                        relevant += event.data["relevant"]
        print(f"constraint {'on ' if constrained else 'off'}: {parsed}/{total} replies parsed to YES/NO, "
              f"{relevant}/{total} classified relevant", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
