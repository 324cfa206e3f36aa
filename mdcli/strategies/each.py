"""ask-many --each (and margins --each): the same questions asked of every document on its own.

Each document is its own ask-many job (AskMany with that one document): its prompts are exactly
those of `mdcli ask-many FILE -q ...` for that file alone, so its prefix is laid down once and its
questions branch from it. Many documents' trees decode in one forest (one Run, one shared cache,
one forward a step for every live branch). Documents are admitted in input order while the ones in
flight hold at most `budget_tokens` cache tokens (each document's cost: its prompt trie plus every
question's new tokens; one document is always admitted, however large): at the start, and before
every step after a document has finished, so the forest stays full. A document admitted mid-forest
is laid down between two steps (the slots of the finished ones reclaimed first), its prompts
prefilled on their own (its prefix a causal run, not masked against the others), and its branches
join the next step. On a CPU core a forest of three or four short documents measured fastest
(CPU_BUDGET_TOKENS): most of the gain there is the one process and the one load.

A Margins job (margins --each) packs consecutive documents, as many as `budget_tokens` holds of
their margins (at least one), into one forest that runs margins' three phases for all of them
(strategies/each_margins.py).

Exactness: a branch's tokens do not depend on what else is in the forest, or on when it joined:
its sampler is seeded by its question's place in its document (the branch id it would have
alone), and a context cap applies per branch as it does alone; so every document's answers are
those of its run alone.

A document is reported once, whole, as soon as its last question finishes (`DocumentDone`), with
a key (`entry_key`) that a rerun appending to the same output matches to skip it. `index` is its
place in the input, a file that could not be read counted where it was found.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING

from mdcli.backends.host import available_memory_bytes
from mdcli.core.decoding import BranchSpec, Independent
from mdcli.core.steps import StepLoop, Tip
from mdcli.documents.inputs import Document, Skipped
from mdcli.errors import MdcliError
from mdcli.events import Answer, DocumentDone, DocumentRef, Event, Finish, Note, Progress
from mdcli.models.memory import kv_bytes_per_token
from mdcli.strategies.ask_many import AskMany, unretrieved_notes
from mdcli.strategies.each_margins import MarginsDocument, answer_margins, prepare_margins
from mdcli.strategies.job import RunOptions, run_options
from mdcli.strategies.margins import Margins
from mdcli.strategies.memory import check_forest_fits, trie_tokens

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel

CPU_BUDGET_TOKENS = 2048
"""A forest's most cache tokens on a CPU when --budget-tokens is not given: three or four documents
of a few hundred tokens. On one Zen 5 core (invoices of 205-598 tokens, 3 questions, 32 tokens,
alternated three times) a file took 0.839-0.853 s at 2,048 against 0.873-0.895 s at 1,024 and
0.835-0.844 s at 3,072: a step shared by several documents saves its glue, and each document's
queries read only their own slots (mdcli.backends.attention.documents), while the products grow
by a row per branch either way (notebook/ask-many.md, "ask-many --each at the issue's document
sizes")."""
MAX_BUDGET_TOKENS = 65536  # elsewhere (a GPU): as much as a quarter of the free memory holds, up to this


def document_sha256(text: str) -> str:
    """The content hash a document is keyed by: sha256 of its text as read (UTF-8)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def model_identity(model: LoadedModel) -> str:
    """What of a loaded model changes tokens: its name, dtype, device kind and weight format."""
    dtype = str(model.dtype).removeprefix("torch.")
    return f"{model.name}|{dtype}|{model.device.type}|{model.cpu_weights}"


def job_options(job: AskMany | Margins) -> dict:
    """The job's fields that change tokens, documents aside (ask-many: questions, template, system,
    chat template, sampling, max_new_tokens, stop strings, retrieval, constraint; margins: every
    option and prompt), with the strategy's name."""
    strategy = "margins" if isinstance(job, Margins) else "ask-many"
    return {"strategy": strategy, **job.model_dump(mode="json", exclude={"document", "documents", "names"})}


def asked(job: AskMany | Margins) -> list[str]:
    """The questions, in order (a margins job's one `query` when it has no `questions`)."""
    return list(job.questions) if job.questions else [job.query]  # type: ignore[union-attr]


def entry_key(path: str, sha256: str, options: dict, model: str) -> str:
    """The key a finished document is written under: its path, content hash, the questions and
    the options that change tokens, and the model. A rerun skips a document whose key is there."""
    body = json.dumps({"path": path, "sha256": sha256, "options": options, "model": model}, sort_keys=True)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


@dataclass
class _Prepared:
    """One document ready to decode: its branches, or why it cannot run."""

    index: int
    document: DocumentRef
    key: str | None
    questions: list[str]
    specs: list[BranchSpec]
    cost: int = 0  # cache tokens: the prompts' trie and every branch's new tokens
    error: str | None = None
    margins: MarginsDocument | None = None  # margins: its job on this document alone


def default_budget(model: LoadedModel) -> int:
    """CPU_BUDGET_TOKENS on a CPU; elsewhere what a quarter of the device's free memory holds of KV
    cache, at most MAX_BUDGET_TOKENS."""
    free = available_memory_bytes(model.device)
    if model.device.type == "cpu" or free is None:
        return CPU_BUDGET_TOKENS
    per_token = kv_bytes_per_token(model.model.config, model.dtype.itemsize)
    return max(1, min(MAX_BUDGET_TOKENS, free // (4 * per_token)))


def run_each(
    model: LoadedModel,
    job: AskMany | Margins,
    documents: Sequence[Document],
    skipped: Sequence[Skipped] = (),
    *,
    answered: frozenset[str] | set[str] = frozenset(),
    indices: Sequence[int] | None = None,
    budget_tokens: int | None = None,
    options: RunOptions | None = None,
    **engine,
) -> Iterator[Event]:
    """Answer `job`'s questions about every document, one tree per document (module docstring).

    Yields a `DocumentDone` per document as it finishes (an error one for each of `skipped` and
    each document that cannot run, e.g. one too long for the model), each followed by
    `Progress("documents", done, total, "documents")`; and the forests' notes. A document whose
    key is in `answered` is not run (one `each` note counts them). `indices`: each document's
    place in the input order (default: each document's and each skipped file's place as read,
    documents.inputs.Skipped.before).

    A Margins job packs documents into forests of margins' three phases (module docstring): the
    answers are those of `mdcli margins FILE` on each file."""
    forests = run_options(options, engine, every=True)  # how each forest runs (RunOptions, or its fields as keywords)
    options, identity = job_options(job), model_identity(model)
    places, skipped_places = input_places(len(documents), skipped)
    if indices is not None:
        places = list(indices)
    prepared, already = [], 0
    for place, document in zip(places, documents):
        sha = document_sha256(document.text)
        key = entry_key(document.path, sha, options, identity)
        if key in answered:
            already += 1
            continue
        if isinstance(job, Margins):
            prepared.append(_prepare_margins(model, job, place, document, sha, key))
        else:
            prepared.append(_prepare(model, job, place, document, sha, key))
    refused = [
        _Prepared(place, DocumentRef(s.path, None), None, asked(job), [], error=f"skipped: {s.reason}")
        for place, s in zip(skipped_places, skipped)
    ]
    total = len(prepared) + len(refused)
    if already:
        yield Note("each", f"{already} of {already + total} documents already answered in the output: skipped",
                   {"skipped": already, "documents": already + total})
    done = 0
    yield Progress("documents", done, total, "documents")
    for item in refused + [p for p in prepared if p.error is not None]:
        done += 1
        yield _done(item, [])
        yield Progress("documents", done, total, "documents")
    budget = budget_tokens if budget_tokens is not None else default_budget(model)
    if isinstance(job, Margins):
        ready = [p for p in prepared if p.error is None]
        events = (event for batch in pack(ready, budget) for event in _run_margins(model, batch, forests))
    else:
        events = _run_admitting(model, [p for p in prepared if p.error is None], budget, job.retrieve is not None,
                                forests)
    for event in events:
        yield event
        if isinstance(event, DocumentDone):
            done += 1
            yield Progress("documents", done, total, "documents")


def input_places(documents: int, skipped: Sequence[Skipped]) -> tuple[list[int], list[int]]:
    """Each document's and each skipped file's place in the input order: a skipped file sits after
    the `before` documents read ahead of it (documents.inputs.Skipped), skipped files that sit
    together in their listed order."""
    ranked = sorted(range(len(skipped)), key=lambda n: skipped[n].before)  # stable: listed order kept
    skipped_places = [0] * len(skipped)
    for rank, n in enumerate(ranked):
        skipped_places[n] = min(skipped[n].before, documents) + rank
    places = [d + sum(1 for s in skipped if s.before <= d) for d in range(documents)]
    return places, skipped_places


def _prepare(model: LoadedModel, job: AskMany, index: int, document: Document, sha: str, key: str) -> _Prepared:
    """The document's branches, exactly those of ask-many on it alone; an error it cannot run with."""
    ref = DocumentRef(document.path, sha)
    try:
        specs = job.model_copy(update={"documents": [document], "document": ""}).branches(
            model.tokenizer, model.context_length
        )
    except MdcliError as error:
        return _Prepared(index, ref, key, list(job.questions), [], error=error.line())
    for number, spec in enumerate(specs):
        if spec.seed_key is None:
            spec.seed_key = number  # the branch id it has when the document runs alone
        spec.label = f"{document.path} :: {spec.label}"
    cost = trie_tokens([spec.prompt_ids for spec in specs]) + sum(spec.max_new_tokens for spec in specs)
    return _Prepared(index, ref, key, list(job.questions), specs, cost)


def pack(prepared: list[_Prepared], budget: int) -> Iterator[list[_Prepared]]:
    """Consecutive documents, as many as fit in `budget` cache tokens (at least one each time)."""
    batch, used = [], 0
    for item in prepared:
        if batch and used + item.cost > budget:
            yield batch
            batch, used = [], 0
        batch.append(item)
        used += item.cost
    if batch:
        yield batch


def _prepare_margins(model: LoadedModel, job: Margins, index: int, document: Document, sha: str,
                     key: str) -> _Prepared:
    """The document's margins job, named as `mdcli margins FILE` names it; an error it cannot run with."""
    item = _Prepared(index, DocumentRef(document.path, sha), key, asked(job), [])
    try:
        item.margins = prepare_margins(model, job, document.text, PurePath(document.path).name)
    except MdcliError as error:
        item.error = error.line()
        return item
    item.cost = item.margins.cost
    return item


def _run_margins(model: LoadedModel, batch: list[_Prepared], options: RunOptions) -> Iterator[Event]:
    """margins on a batch of documents in one forest (each_margins); each document's DocumentDone as
    its answers are done. A batch that fails (a prompt too long for the model, say) runs again one
    document at a time, so that only the document at fault becomes an error record."""
    try:
        finished = list(answer_margins(model, [item.margins for item in batch], options))
    except MdcliError as error:
        if len(batch) > 1:
            for item in batch:
                yield from _run_margins(model, [item], options)
            return
        batch[0].error = error.line()
        yield _done(batch[0], [])
        return
    for place, answers in finished:
        yield _done(batch[place], answers)


def _run_admitting(model: LoadedModel, queue: list[_Prepared], budget: int, retrieves: bool,
                   options: RunOptions) -> Iterator[Event]:
    """Every document of `queue` in one forest, admitted as room frees up (module docstring); each
    document's DocumentDone when its last branch ends."""
    run = options.run(model)
    loop = StepLoop(run, Independent(None), model.tokenizer, model.eos_token_ids)
    waiting = deque(queue)
    flight: dict[int, _Prepared] = {}  # index -> a document admitted and not yet done
    owner: dict[int, tuple[_Prepared, int]] = {}  # branch id -> (its document, its question number)

    def room() -> bool:
        return bool(waiting) and (not flight or sum(d.cost for d in flight.values()) + waiting[0].cost <= budget)

    def admit(loop: StepLoop) -> Iterator[Event]:
        if room() and loop.live:  # the finished documents' slots go before the next is laid down
            loop.compact(loop.live)
        elif room():
            run.empty_cache()
        while room():
            item = waiting.popleft()
            flight[item.index] = item
            check_forest_fits(
                model, prompt_tokens=sum(d.cost for d in flight.values()),
                branches=sum(len(d.specs) for d in flight.values()), new_tokens=0,
                what=f"a forest of {len(flight)} documents", fix="lower --budget-tokens, or -n",
            )
            tips = [_tip(loop, spec) for spec in item.specs]
            owner.update({tip.id: (item, number) for number, tip in enumerate(tips)})
            if retrieves:
                yield from unretrieved_notes(item.specs)
            yield from loop.capped_notes(tips)
            # laid down alone, in a cache of its own when others are in this one: its prefix a plain
            # causal run, not masked against the others' slots
            for event in loop.prefill(tips, "prefill", apart=len(run.engine) > 0):
                if isinstance(event, Note):
                    yield event
            loop.join(tips)

    answers: dict[int, dict[int, Answer]] = {item.index: {} for item in queue}
    for event in loop.run_tips([], admit):
        if isinstance(event, Note):
            yield event
        elif isinstance(event, Finish) and event.branch in owner:
            item, number = owner.pop(event.branch)
            got = answers[item.index]
            got[number] = Answer(
                question=item.questions[number], text=event.text, token_ids=event.token_ids,
                finish_reason=event.finish_reason, cumulative_logprob=event.cumulative_logprob, parsed=event.parsed,
            )
            if len(got) == len(item.specs):
                del flight[item.index], answers[item.index]
                yield _done(item, [got[n] for n in range(len(item.specs))])


def _tip(loop: StepLoop, spec: BranchSpec) -> Tip:
    """A root tip for `spec`, as core.decoding.Decoder.announce makes one."""
    return loop.tip(spec.label, list(spec.prompt_ids), sampling=spec.sampling, seed_key=spec.seed_key,
                    max_new_tokens=spec.max_new_tokens, stop=spec.stop, ignore_eos=spec.ignore_eos, data=spec,
                    constraint=spec.constraint)


def _done(item: _Prepared, answers: list[Answer]) -> DocumentDone:
    return DocumentDone(document=item.document, index=item.index, answers=answers, key=item.key, error=item.error)
