"""The Python API. The command line is a thin consumer of exactly these functions.

    from mdcli import load_model, ask_many
    model = load_model()                       # the embedded SmolLM2-135M-Instruct
    for event in ask_many(model, story, ["Who is the main character?", "Where is it set?"]):
        if event.type == "finish":
            print(event.label, "->", event.text)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mdcli import settings
from mdcli.prompt_cache import listing
from mdcli.prompt_cache.key import cache_folder
from mdcli.prompt_cache.listing import Entry as PromptCacheEntry
from mdcli.core.decoding import BranchSpec, Decoder
from mdcli.events import Event, Note
from mdcli.core.sampling import SamplingParams
from mdcli.strategies.ask_many import AskMany, unretrieved_notes
from mdcli.strategies.each import CPU_BUDGET_TOKENS, entry_key, run_each
from mdcli.documents.inputs import Document, Inputs, read_inputs
from mdcli.strategies.beam import Beam, beam_prompts, check_beam_fits, run_beam
from mdcli.strategies.explore import Explore, run_explore
from mdcli.strategies.margins import Margins, MarginsPrompts, run_margins
from mdcli.strategies.memory import check_forest_fits, trie_tokens
from mdcli.strategies.job import RunOptions, run_options
from mdcli.strategies.think import Think, run_think

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel


def run_specs(
    model: LoadedModel,
    specs: list[BranchSpec],
    *,
    strategy: str,
    seed: int | None = None,
    options: RunOptions | None = None,
    notes: Sequence[Note] = (),
    **engine,
) -> Iterator[Event]:
    """Decode independent branches (with optional follow-up children) in one shared cache.
    `notes` follow the start event (facts about how the branches were built, e.g. a question
    that retrieved no passage). `options` (a RunOptions, or its fields as keywords: speculate
    "off" by default here, the command line's is "auto"): how the engine runs; the tokens are the
    same either way. A forest too large for the device's free memory is refused when this is
    called, before any event (strategies/memory.py)."""
    options = run_options(options, engine, every=True)
    check_specs_fit(model, specs)
    return _run_specs(model, specs, strategy=strategy, seed=seed, options=options, notes=tuple(notes))


def check_specs_fit(model: LoadedModel, specs: list[BranchSpec]) -> None:
    """The memory estimate of strategies/memory.py for these branches and their follow-ups: the
    roots' prompts as one trie, each follow-up's own prompt, every branch's new tokens."""
    everything, pending = [], list(specs)
    while pending:
        spec = pending.pop()
        everything.append(spec)
        pending.extend(spec.children)
    if not everything:
        return
    follow_ups = sum(len(spec.prompt_ids) for spec in everything) - sum(len(spec.prompt_ids) for spec in specs)
    check_forest_fits(
        model, prompt_tokens=trie_tokens([spec.prompt_ids for spec in specs]) + follow_ups, branches=len(everything),
        new_tokens=max(spec.max_new_tokens for spec in everything), what=f"a forest of {len(everything):,} branches",
        fix="run fewer branches at once, or lower their max_new_tokens (-n)",
    )


def _run_specs(model: LoadedModel, specs: list[BranchSpec], *, strategy: str, seed: int | None,
               options: RunOptions, notes: tuple[Note, ...]) -> Iterator[Event]:
    run = options.run(model)
    decoder = Decoder(run, model.tokenizer, model.eos_token_ids)
    branches = decoder.announce(specs)
    yield run.start(strategy, seed, branches)
    yield from notes
    yield from decoder.decode()
    yield run.done()



def ask_many(
    model: LoadedModel,
    document: str | AskMany,
    questions: list[str] | tuple[str, ...] = (),
    *,
    options: RunOptions | None = None,
    **fields,
) -> Iterator[Event]:
    """Answer every question about `document`, all decoding together over the document's cache.

    `document` is an AskMany job, or the document text with `questions` and the job's fields as
    keywords (system, template, chat_template, sampling, max_new_tokens=256, stop, documents,
    retrieve, chunk_tokens: see strategies.ask_many.AskMany). `options`, a RunOptions (or its
    fields as keywords, as for every function here), go to the run."""
    options = run_options(options, fields)
    job = document if isinstance(document, AskMany) else _ask_many_job(fields, document=document, questions=questions)
    specs = job.branches(model.tokenizer, model.context_length)
    notes = unretrieved_notes(specs) if job.retrieve is not None else []
    return run_specs(model, specs, strategy="ask-many", seed=job.sampling.seed, notes=notes, options=options)


def ask_each(
    model: LoadedModel,
    documents: Sequence[str | Path | Document] | Inputs,
    questions: list[str] | tuple[str, ...] | AskMany | Margins = (),
    *,
    answered: Sequence[str] = (),
    budget_tokens: int | None = None,
    options: RunOptions | None = None,
    **fields,
) -> Iterator[Event]:
    """The same questions about every document, each document its own tree, many trees decoding in
    one forest (strategies/each.py): each document's answers are those of `ask_many` on it alone.

    `documents`: Documents (path + text), or files, folders and globs read as the command line
    reads them (a file that is not text becomes an error record, not an exception); or an Inputs.
    `questions`: the questions, with the job's fields as keywords as for `ask_many`, or an AskMany
    job (its documents ignored); or a Margins job: each document then runs `margins` on its own,
    one after the other, each answer the branch its `answer-sources` note names. `answered`: keys (DocumentDone.key) of documents not to run again.
    `budget_tokens`: a forest's most cache tokens (default: strategies.each.default_budget).
    Yields a DocumentDone per document as it finishes, a Progress("documents", ...) after each, and
    the forests' notes. `options`: how each forest runs (RunOptions, or its fields as keywords).
    Arguments are checked here, before the first event is asked for."""
    options = run_options(options, fields)
    if isinstance(questions, Margins):
        questions.model_copy(update={"documents": ["(each)"], "names": ["(each)"]}).validate()
        inputs = documents if isinstance(documents, Inputs) else _each_inputs(documents)
        return run_each(model, questions, inputs.documents, inputs.skipped, answered=frozenset(answered),
                        budget_tokens=budget_tokens, options=options)
    job = questions if isinstance(questions, AskMany) else _ask_many_job(fields, questions=questions)
    job.model_copy(update={"document": "(each)", "documents": []}).validate()
    inputs = documents if isinstance(documents, Inputs) else _each_inputs(documents)
    return run_each(model, job, inputs.documents, inputs.skipped, answered=frozenset(answered),
                    budget_tokens=budget_tokens, options=options)


def _ask_many_job(options: dict, questions, **fields) -> AskMany:
    """An AskMany job of `questions` from the API's keywords (`options`, the job's fields) and
    `fields`; a template or sampling given empty or None takes the job's default."""
    given = {k: _listed(k, v) for k, v in options.items() if not (k in ("template", "sampling") and not v)}
    return AskMany(questions=list(questions), **fields, **given)


def _each_inputs(documents: Sequence[str | Path | Document]) -> Inputs:
    """Documents kept as given; paths, folders and globs read (leniently), in the order given."""
    inputs = Inputs()
    for item in documents:
        if isinstance(item, Document):
            inputs.documents.append(item)
        else:
            found = read_inputs([str(item)], lenient=True)
            ahead = len(inputs.documents)  # a skipped file's `before` counts every document read so far
            inputs.skipped.extend(replace(s, before=s.before + ahead) for s in found.skipped)
            inputs.documents.extend(found.documents)
    return inputs


def margins(
    model: LoadedModel,
    documents: str | list[str] | Margins,
    query: str | None = None,
    *,
    questions: list[str] | None = None,
    names: list[str] | None = None,
    context: str | None = None,
    segment_tokens: int | None = None,
    keep: str | None = None,
    classify: bool | None = None,
    with_segments: bool | None = None,
    prompts: MarginsPrompts | None = None,
    chat_template: bool | None = None,
    sampling: SamplingParams | None = None,
    max_new_tokens: int | None = None,
    classify_tokens: int | None = None,
    answer_tokens: int | None = None,
    memory_budget_bytes: int | None = None,
    options: RunOptions | None = None,
    **engine,
) -> Iterator[Event]:
    """Writing in the Margins: a margin per segment (all at once), each classified relevant or
    not (all at once), then one answer from the relevant margins. `query` asks one question;
    `questions` asks several over one shared cache (a margin per question and segment, an answer
    per question, each phase one set of forwards). `context`: "chain" (each margin
    reads segments 1..i; the default for one document) or "independent" (each reads its segment
    alone; the default for several). `prompts`: a strategies.margins.MarginsPrompts. Events and
    templates are documented in mdcli/strategies/margins/ (run.py and job.py).

    `documents` is a Margins job, or the document text(s) with the job's fields as keywords: a
    keyword left None takes the job's default (strategies.margins.Margins, MarginsOptions;
    `context` is its `layout`, `max_new_tokens` its `margin_tokens`). `options` (RunOptions, or
    its fields as keywords) go to the run. Arguments are checked here, before the first event is
    asked for."""
    options = run_options(options, engine, every=True)
    fields = {
        "query": query, "questions": questions, "names": names, "layout": context, "segment_tokens": segment_tokens,
        "keep": keep, "classify": classify, "with_segments": with_segments, "prompts": prompts,
        "chat_template": chat_template, "sampling": sampling, "margin_tokens": max_new_tokens,
        "classify_tokens": classify_tokens, "answer_tokens": answer_tokens, "memory_budget_bytes": memory_budget_bytes,
    }
    given = {name: value for name, value in fields.items() if value is not None}
    if isinstance(documents, Margins):
        if given:
            raise TypeError(f"margins() got a Margins job and its fields as keywords too ({', '.join(given)})")
        job = documents
    else:
        if "questions" in given:
            given["questions"] = list(given["questions"])
        job = Margins(documents=[documents] if isinstance(documents, str) else list(documents), **given)
    job.validate()
    return run_margins(model, job, options)


# -- beam search ---------------------------------------------------------------------------------


def beam_search(
    model: LoadedModel,
    prompt: str | Beam,
    questions: list[str] | tuple[str, ...] = (),
    *,
    options: RunOptions | None = None,
    **fields,
) -> Iterator[Event]:
    """Beam search with the rules and scores of `generate(num_beams=width, do_sample=False)`,
    every beam a leaf of one shared cache.

    `prompt` is a Beam job, or the prompt text with the job's fields as keywords (width=4,
    num_return=1, length_penalty=1.0, early_stopping=False, max_new_tokens=64, system, template,
    chat_template: see strategies.beam.Beam). Without `questions`, `prompt` is the prompt text: one
    beam set. With them, `prompt` is a document and each question gets its own beam set (the
    ask-many template), all stepping in the same forward. `options` (RunOptions, or its fields as
    keywords) go to the run; beam search does not speculate, and says why. Options are checked,
    and a width that cannot fit in memory refused, here, before anything runs; the events come
    when the returned iterator is consumed.
    """
    options = run_options(options, fields)
    job = prompt if isinstance(prompt, Beam) else Beam(prompt=prompt, questions=list(questions), **fields)
    job.validate()
    prompts = beam_prompts(model.tokenizer, job.prompt, job.questions, job.system, job.template, job.chat_template)
    params = job.params
    check_beam_fits(model, [len(p.prompt_ids) for p in prompts], params)
    return run_beam(model, prompts, params, options)


def explore(model: LoadedModel, prompt: str | Explore, *, options: RunOptions | None = None, **fields) -> Iterator[Event]:
    """Step-level search: at each step boundary `k` sampled candidates per kept path decode
    together, are scored ("logprob" or "judge"), and the best `keep` go on (see
    mdcli/strategies/explore.py). `prompt` is an Explore job, or the prompt text with the job's
    fields as keywords (k=4, keep=1, chunk_tokens=None, score="logprob", system, chat_template,
    sampling: temperature 0.8 when not given, since greedy candidates would be identical,
    max_new_tokens=256); `options` (RunOptions, or its fields as keywords) go to the run; explore
    does not speculate, and says why. Arguments are checked here, before the first event is
    asked for."""
    options = run_options(options, fields)
    if isinstance(prompt, Explore):
        job = prompt
    else:
        if fields.get("sampling", ...) is None:
            del fields["sampling"]
        job = Explore(prompt=prompt, **fields)
    job.validate()
    return run_explore(model, job, options)


def think(model: LoadedModel, question: str | Think, *, options: RunOptions | None = None, **fields) -> Iterator[Event]:
    """Parallel chains of thought: `paths` independent paths (or, with `plan=True`, one path per
    item of an outline the model writes first) decode together over the question's cache, then
    `merge` ("reencode": exact conclusion, "attend": approximate Multiverse-style conclusion,
    "none"; default reencode, or none when voting) and/or `vote` (majority over each path's
    extracted answer, reported in a Note with data {"answers": {...}, "winner": ...}).

    `question` is a Think job, or the question text with the job's fields as keywords (see
    strategies.think.Think: paths=4, plan, max_paths=8, merge, vote, answer_pattern,
    path_instructions, system, chat_template, sampling (None: sampled where greedy paths would be
    identical), max_new_tokens=256, plan_tokens (None: min(128, max_new_tokens)), conclusion_tokens
    (None: max_new_tokens), stop); `options` (RunOptions, or its fields as keywords) go to the
    run. Arguments are checked here, before the first event is asked for.
    """
    options = run_options(options, fields)
    if isinstance(question, Think):
        job = question
    else:
        if fields.get("sampling", ...) is None:
            del fields["sampling"]
        job = Think(question=question, **{k: _listed(k, v) for k, v in fields.items()})
    job.validate()
    return run_think(model, job, options)


# -- the prompt cache's folder ---------------------------------------------------------------------


def prompt_cache_entries(prompt_cache: str = "auto") -> tuple[Path | None, list[PromptCacheEntry]]:
    """The folder `prompt_cache` (auto | a folder) names and its entries, most recently used first."""
    folder = cache_folder(prompt_cache, settings.current())
    return folder, (listing.entries(folder) if folder is not None else [])


def clear_prompt_cache(prompt_cache: str = "auto", older_than: str | None = None) -> tuple[Path | None, int, int]:
    """Remove the entries of the folder `prompt_cache` names (only those unused for longer than
    `older_than`, e.g. "7d", when given): (folder, entries removed, bytes freed)."""
    age = listing.parse_age(older_than) if older_than is not None else None
    folder = cache_folder(prompt_cache, settings.current())
    if folder is None:
        return None, 0, 0
    return (folder, *listing.clear(folder, age))


def _listed(name: str, value):
    """path_instructions and stop as the job keeps them, from any sequence."""
    if name == "path_instructions":
        return list(value)
    if name == "stop":
        return tuple(value)
    return value


# -- the rest of the public API: what a caller (the command line among them) needs besides the
# -- functions above, to check its arguments before loading a model, to load one, and to draw a
# -- recipe's forest without one. Re-exported here so that callers depend on this module only.

from mdcli.core.decoding import BranchSpec  # noqa: E402, F811
from mdcli.explain.forest import ForestLayout, plan_layout, render_explanation  # noqa: E402
from mdcli.explain.step import describe_step, first_verified_step  # noqa: E402
from mdcli.models.load import LoadedModel, LoadOptions, load_model, load_tokenizer  # noqa: E402
from mdcli.backends.host import host_report  # noqa: E402
from mdcli.settings import changed_settings  # noqa: E402
from mdcli.constraints import Constraint  # noqa: E402
from mdcli.core.sampling import SamplingParams  # noqa: E402, F811
from mdcli.strategies.segmenting import DEFAULT_SEGMENT_TOKENS, MIN_SEGMENT_TOKENS  # noqa: E402
from mdcli.speculative.planner import Speculate, parse_speculate  # noqa: E402
from mdcli.strategies.ask_many import DEFAULT_TEMPLATE as ASK_MANY_TEMPLATE  # noqa: E402
from mdcli.strategies.beam import BeamParams, parse_early_stopping  # noqa: E402
from mdcli.strategies.job import FieldError  # noqa: E402
from mdcli.strategies.margins import DEFAULT_ANSWER_TOKENS, DEFAULT_CLASSIFY_TOKENS, DEFAULT_MARGIN_TOKENS  # noqa: E402
from mdcli.documents.inputs import Skipped, joined_text, named_text  # noqa: E402

__all__ = [
    # running: each returns an iterator of events (mdcli.events)
    "ask_each", "ask_many", "beam_search", "explore", "margins", "run_specs", "think",
    # loading, and how a run runs (every function above takes `options=RunOptions(...)`)
    "LoadedModel", "LoadOptions", "load_model", "load_tokenizer", "RunOptions",
    # what `mdcli info` reports: the host, the settings that differ from their defaults
    "host_report", "changed_settings",
    # the jobs and settings the functions above build, for checking arguments before a model is loaded
    "ASK_MANY_TEMPLATE", "AskMany", "unretrieved_notes", "Beam", "BeamParams", "BranchSpec", "Constraint", "Explore", "Margins", "MarginsPrompts", "SamplingParams",
    "Speculate", "Think", "FieldError", "parse_early_stopping", "parse_speculate",
    "DEFAULT_ANSWER_TOKENS", "DEFAULT_CLASSIFY_TOKENS", "DEFAULT_MARGIN_TOKENS", "DEFAULT_SEGMENT_TOKENS",
    "MIN_SEGMENT_TOKENS", "CPU_BUDGET_TOKENS", "entry_key",
    # the prompt cache on disk (mdcli cache list / clear)
    "PromptCacheEntry", "clear_prompt_cache", "prompt_cache_entries",
    # many inputs: files, folders, globs and stdin read as documents with their paths
    "Document", "Inputs", "Skipped", "joined_text", "named_text", "read_inputs",
    # describing a run without running it
    "ForestLayout", "plan_layout", "render_explanation",
    # one speculative step of a run, watched and drawn (mdcli explain --speculate)
    "describe_step", "first_verified_step",
]
