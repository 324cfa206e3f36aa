"""margins: Writing in the Margins (Russak et al. 2024) with every margin written at once, for
one question or many.

The paper reads a long context segment by segment; after each segment the model writes a
*margin*, an extractive note of what is relevant to the query, then rolls its cache back and
reads on. Margins are classified relevant or not by the same model, and the relevant ones are put
before the query for the final answer. Here each of the three stages is ONE decoding phase of one
`Decoder` over one shared cache, for every question at once:

1. margins, all at once: one branch per (question, segment), question-major. Each prompt is built
   and tokenized WHOLE: the chat-templated user turn `MARGIN_TEMPLATE` with `$context` and
   `$query`. What `$context` holds is the layout:

   * `chain` (default for one document, as in the paper): segments 1..i of the documents read so
     far; documents are separated by a blank line and each is stripped of surrounding whitespace.
     Prompt i+1 extends prompt i's context, so the radix prefill (run.prefill_prompts)
     stores the document about once, plus one instruction per margin.
   * `independent` (default for several documents, retrieved passages): segment i alone,
     stripped. Only the system prompt and the template's head are shared.

   The context comes before the query, so every question's margin of one segment shares that
   segment's tokens: Q questions store the document once, plus Q instructions per segment.

2. classification, all at once: for each margin `CLASSIFICATION_TEMPLATE` ($query, $margin),
   answered "YES#reason" or "NO#reason" (the paper's prompt). Always greedy: a verdict should not
   be sampled. Decoded under CLASSIFICATION_CONSTRAINT ("(YES|NO)#" and one line) unless
   `classify_constraint=False`. Read by `parse_verdict`; a reply with no YES/NO counts as relevant, and the Note
   says it was not understood. Skipped with `classify=False` (every margin is kept).

3. the answers, one branch per question, all at once: `ANSWER_TEMPLATE` with `$notes` (the
   question's kept margins in segment order, each rendered with `NOTE_TEMPLATE`, or
   `NOTE_WITH_SEGMENT_TEMPLATE` when the source segments are included) and `$query`; `NO_NOTES`
   stands in when no margin is kept.

Every branch is exact: its tokens are what the model gives its `prompt_token_ids` alone, and each
question's prompts are the ones a run of that question alone builds (so the tokens are the same).
The cache is emptied between phases (nothing later reuses the document).

Events: Start (the margin branches, labelled "segment 3/8", or "segment 3/8 (doc2.txt)" for several
documents; with several questions "q2 segment 3/8"; every branch's `group` is its question); Note kind
"margins-layout" (prompt tokens, how many of them the cache holds, the questions); Note kind
"segment-split" for each segment cut inside a sentence; the margins' Token/Finish; a Fork per
classification branch ("classification 3/8", or "q2 classification 3/8") and their Token/Finish, each Finish
followed by Note kind "classification" with data {"branch", "margin_branch", "question",
"segment", "document", "relevant", "parsed", "reason", "constraint"}; a Fork per answer ("answer", or the
question itself when there are several), their Tokens, and right before each answer's Finish a
Note kind "answer-sources" with data {"branch", "question", "segments", "margin_branches"}; Done
with the stats of all phases. Segment and question numbers are 1-based, as in the labels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mdcli.core.decoding import BranchSpec, Decoder
from mdcli.events import BranchInfo, Event, Finish, Fork, Note, Source
from mdcli.strategies.job import RunOptions, run_options
from mdcli.strategies.segmenting import Segment
from mdcli.strategies.margins.fit import check_fits
from mdcli.strategies.margins.job import MarginResult, Margins, parse_verdict

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel

def new_decoder(model: LoadedModel, options: RunOptions | None = None, **engine) -> Decoder:
    """A Decoder over a new Run for `model` (one engine, one cache) for every phase; `options` (or
    RunOptions' fields as keywords) say how the engine runs."""
    run = run_options(options, engine, every=True).run(model)
    return Decoder(run, model.tokenizer, model.eos_token_ids)


def run_margins(model: LoadedModel, job: Margins, options: RunOptions | None = None, **engine) -> Iterator[Event]:
    """The three phases over one decoder; see the module docstring for the event stream. `options`
    (or RunOptions' fields as keywords): how the engine runs; margins honours them all."""
    job.validate()
    tokenizer = model.tokenizer
    segments = job.segments(tokenizer)
    specs = job.margin_specs(tokenizer, segments)
    prefill_tokens = check_fits(model, job, segments, specs)
    decoder = new_decoder(model, options, **engine)

    count = len(segments)
    infos = grouped(job, decoder.announce(specs), [i // count for i in range(len(specs))])
    yield decoder.run.start("margins", job.sampling.seed, infos)
    yield layout_note(job, segments, specs, prefill_tokens)
    yield from split_notes(job, segments)
    finishes = yield from _collect_finishes(decoder.decode("margins"))
    labels = job.labels(segments)
    margins = [
        MarginResult(
            number=i % count + 1, segment=segments[i % count], label=labels[i % count], branch=info.id,
            text=finishes[info.id].text, question=i // count,
        )
        for i, info in enumerate(infos)
    ]
    decoder.run.empty_cache()

    if job.classify:
        yield from classify_margins(decoder, job, margins)
        decoder.run.empty_cache()

    yield from answer(decoder, job, margins, count, segment_lines(segments))
    yield decoder.run.done()


def grouped(job: Margins, infos: list[BranchInfo], questions: list[int]) -> list[BranchInfo]:
    """Each branch labelled with its question (its `group`)."""
    return [dataclasses.replace(info, group=job.group(q)) for info, q in zip(infos, questions)]


def classify_margins(decoder: Decoder, job: Margins, margins: list[MarginResult]) -> Iterator[Event]:
    """Phase 2: one greedy YES/NO branch per margin, all at once; a Note as each one finishes."""
    specs = job.classification_specs(decoder.tokenizer, margins)
    infos = grouped(job, decoder.announce(specs), [m.question for m in margins])
    by_branch = {}
    for margin, info in zip(margins, infos):
        margin.classification_branch = info.id
        by_branch[info.id] = margin
        yield Fork(branch=info)
    for event in decoder.decode("classification"):
        yield event
        if isinstance(event, Finish) and event.branch in by_branch:
            yield classification_note(job, by_branch[event.branch], event)


def classification_note(job: Margins, margin: MarginResult, finish: Finish) -> Note:
    verdict = parse_verdict(finish.text)
    margin.relevant, margin.parsed, margin.reason = verdict.relevant, verdict.parsed, verdict.reason
    label = job.branch_label(margin.question, margin.label)
    if verdict.parsed:
        message = f"{label}: {'relevant' if verdict.relevant else 'not relevant'}"
        message += f" ({verdict.reason})" if verdict.reason else ""
    else:
        message = f"{label}: no YES or NO in the classifier's reply {finish.text.strip()!r}; kept as relevant"
    return Note(
        kind="classification",
        message=message,
        data={
            "branch": finish.branch,
            "margin_branch": margin.branch,
            "question": margin.question + 1,
            "segment": margin.number,
            "document": margin.segment.name,
            "relevant": verdict.relevant,
            "parsed": verdict.parsed,
            "reason": verdict.reason,
            "constraint": job.classify_constraint,  # the reply was decoded under CLASSIFICATION_CONSTRAINT
        },
    )


def answer(
    decoder: Decoder, job: Margins, margins: list[MarginResult], segments: int,
    lines: list[tuple[int, int]] | None = None,
) -> Iterator[Event]:
    """Phase 3: one branch per question reading that question's kept margins, all at once; each
    answer's Fork names the segments of its kept margins as its `sources` (document, lines from
    `lines`, per segment: see segment_lines), and its sources note comes right before its Finish."""
    questions = range(len(job.all_questions()))
    kept = {q: job.kept([m for m in margins if m.question == q]) for q in questions}
    specs = [job.answer_spec(decoder.tokenizer, kept[q], q, segments) for q in questions]
    if lines is not None:
        for q, spec in zip(questions, specs):
            spec.sources = tuple(
                Source(m.segment.name, *lines[m.number - 1], chunk=m.number) for m in kept[q]
            )
    infos = grouped(job, decoder.announce(specs), list(questions))
    question_of = {info.id: q for info, q in zip(infos, questions)}
    for info in infos:
        yield Fork(branch=info)
    for event in decoder.decode("answer"):
        if isinstance(event, Finish) and event.branch in question_of:
            q = question_of[event.branch]
            yield sources_note(event.branch, kept[q], question=q + 1, several=job.several())
        yield event


def segment_lines(segments: list[Segment]) -> list[tuple[int, int]]:
    """(first, last) line, 1-based, of each segment's text in its document (segments of one
    document join back to its text, in order); blank lines at a segment's edges are not counted."""
    spans = []
    line, document = 1, None
    for segment in segments:
        if segment.document != document:
            line, document = 1, segment.document
        text = segment.text
        first = line + text[: len(text) - len(text.lstrip())].count("\n")
        spans.append((first, max(first, line + text.rstrip().count("\n"))))
        line += text.count("\n")
    return spans


def sources_note(branch: int, kept: list[MarginResult], *, question: int = 1, several: bool = False) -> Note:
    numbers = [m.number for m in kept]
    prefix = f"q{question} " if several else ""
    message = prefix + "answer from " + (
        ", ".join(m.label for m in kept) if kept else "no margins (none was relevant)"
    )
    return Note(
        kind="answer-sources",
        message=message,
        data={"branch": branch, "question": question, "segments": numbers, "margin_branches": [m.branch for m in kept]},
    )


def layout_note(job: Margins, segments: list[Segment], specs: list[BranchSpec], prefill: int) -> Note:
    """How much of the margin prompts the cache actually holds (the point of the layout)."""
    prompt_tokens = sum(len(s.prompt_ids) for s in specs)
    document_tokens = sum(s.tokens for s in segments)
    layout = job.resolved_layout()
    questions = [q.strip() for q in job.all_questions()]
    several = f" ({len(questions)} questions x {len(segments)} segments)" if len(questions) > 1 else ""
    shared = ""
    if len(questions) > 1 and job.prompts.question_first():
        shared = "; the margin template puts $query before $context, so the questions share no segment tokens"
    return Note(
        kind="margins-layout",
        message=(
            f"{layout}: {len(specs)} margin prompts{several} of {prompt_tokens:,} tokens in all share "
            f"{prefill:,} cache tokens (documents: {document_tokens:,} tokens){shared}"
        ),
        data={
            "layout": layout,
            "segments": len(segments),
            "questions": questions,
            "margins": len(specs),
            "prompt_tokens": prompt_tokens,
            "prefill_tokens": prefill,
            "document_tokens": document_tokens,
        },
    )


def split_notes(job: Margins, segments: list[Segment]) -> Iterator[Note]:
    """Say where a sentence longer than --segment-tokens had to be cut (never dropped)."""
    labels = job.labels(segments)
    for number, (segment, label) in enumerate(zip(segments, labels), 1):
        if segment.ends_inside_sentence:
            yield Note(
                kind="segment-split",
                message=(
                    f"{label} ends inside a sentence longer than --segment-tokens {job.segment_tokens} "
                    f"(cut at a {segment.ends_at} boundary; the rest opens the next segment)"
                ),
                data={"segment": number, "document": segment.name, "ends_at": segment.ends_at},
            )


def _collect_finishes(events: Iterator[Event]):
    """Pass events through, remembering each Finish by branch (a generator's return value)."""
    finishes: dict[int, Finish] = {}
    for event in events:
        if isinstance(event, Finish):
            finishes[event.branch] = event
        yield event
    return finishes
