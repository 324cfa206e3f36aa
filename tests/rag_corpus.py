"""The project's own small corpus for retrieval tests (tests/data/rag): ten short files, and ten
questions each answered in exactly one of them."""

from __future__ import annotations

from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "data" / "rag"

QUESTIONS = {
    "What is the name of the keeper's cat?": "lighthouse.txt",
    "How much money did the Falcon project spend?": "budget.md",
    "Which tomato variety was planted?": "garden.txt",
    "How long should the apple cake bake?": "recipe.md",
    "How many moons of Jupiter could be seen through the telescope?": "astronomy.txt",
    "How often should the chain be oiled?": "bicycle.md",
    "Who chaired the residents' meeting?": "meeting.txt",
    "How high is the summit of the Puy de Dome?": "volcano.md",
    "Who won every game of the chess tournament?": "chess.txt",
    "What temperature is the aquarium water kept at?": "aquarium.md",
}
