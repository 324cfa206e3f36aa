"""margins --each: several documents' margins in one forest, phase by phase (strategies/each.py).

Each document is its own Margins job, the one `mdcli margins FILE` runs on that file (its one
document named by the file's name). A batch of them runs margins' three phases
(strategies/margins/run.py) over one decoder, one shared cache: every document's margins at once,
then every classification, then every answer, the cache emptied between phases as margins alone
empties it. A branch's tokens do not depend on what else is in the forest, and its sampler is
seeded by the id it has in its own run (the job's seed keys), so each document's answers are those
of margins on it alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mdcli.core.decoding import BranchSpec
from mdcli.events import Answer, Finish
from mdcli.strategies.margins import MarginResult, Margins, check_fits, new_decoder
from mdcli.strategies.job import RunOptions
from mdcli.strategies.margins.run import classification_note
from mdcli.strategies.memory import trie_tokens
from mdcli.strategies.segmenting import Segment

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel


@dataclass
class MarginsDocument:
    """One document's margins job, ready to decode."""

    job: Margins  # margins on this document alone
    segments: list[Segment]
    specs: list[BranchSpec]  # its margins, question-major
    cost: int  # the margins phase's cache tokens: its prompts' trie and every margin's new tokens


def prepare_margins(model: LoadedModel, job: Margins, text: str, name: str) -> MarginsDocument:
    """The document's margins, exactly those of margins on it alone (raises MdcliError, as that
    run would, for a document it cannot read)."""
    one = job.model_copy(update={"documents": [text], "names": [name]})
    one.validate()
    segments = one.segments(model.tokenizer)
    specs = one.margin_specs(model.tokenizer, segments)
    check_fits(model, one, segments, specs)
    cost = trie_tokens([spec.prompt_ids for spec in specs]) + len(specs) * one.margin_tokens
    return MarginsDocument(one, segments, specs, cost)


def answer_margins(model: LoadedModel, documents: list[MarginsDocument], options: RunOptions) -> Iterator[tuple[int, list[Answer]]]:
    """Every document's three phases in one forest; yields (its place in `documents`, its answers
    in question order) as each document's last answer finishes. `options`: the run's options."""
    decoder = new_decoder(model, options)
    tokenizer = decoder.tokenizer
    infos = iter(decoder.announce([spec for document in documents for spec in document.specs]))
    finishes = {event.branch: event for event in decoder.decode("margins") if isinstance(event, Finish)}
    margins: list[list[MarginResult]] = []
    for document in documents:
        count, labels = len(document.segments), document.job.labels(document.segments)
        margins.append([
            MarginResult(number=i % count + 1, segment=document.segments[i % count], label=labels[i % count],
                         branch=info.id, text=finishes[info.id].text, question=i // count)
            for i, info in zip(range(len(document.specs)), infos)
        ])
    decoder.run.empty_cache()
    if documents[0].job.classify:
        specs = [document.job.classification_specs(tokenizer, mine) for document, mine in zip(documents, margins)]
        infos = iter(decoder.announce([spec for mine in specs for spec in mine]))
        judged = {}  # classification branch -> (its document's job, the margin it judges)
        for document, mine in zip(documents, margins):
            for margin, info in zip(mine, infos):
                margin.classification_branch = info.id
                judged[info.id] = (document.job, margin)
        for event in decoder.decode("classification"):
            if isinstance(event, Finish) and event.branch in judged:
                classification_note(*judged[event.branch], event)  # sets the margin's verdict
        decoder.run.empty_cache()
    asked = [document.job.all_questions() for document in documents]
    specs, owners = [], []
    for place, (document, mine) in enumerate(zip(documents, margins)):
        for q in range(len(asked[place])):
            kept = document.job.kept([m for m in mine if m.question == q])
            specs.append(document.job.answer_spec(tokenizer, kept, q, len(document.segments)))
            owners.append((place, q))
    owner = {info.id: where for info, where in zip(decoder.announce(specs), owners)}
    answers: dict[int, dict[int, Answer]] = {place: {} for place in range(len(documents))}
    for event in decoder.decode("answer"):
        if isinstance(event, Finish) and event.branch in owner:
            place, q = owner[event.branch]
            answers[place][q] = Answer(
                question=asked[place][q], text=event.text, token_ids=event.token_ids, finish_reason=event.finish_reason,
                cumulative_logprob=event.cumulative_logprob, parsed=event.parsed,
            )
            if len(answers[place]) == len(asked[place]):
                yield place, [answers[place][n] for n in range(len(asked[place]))]
