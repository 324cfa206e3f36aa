"""think: parallel chains of thought on an unmodified model, as Map / Process / Reduce.

Map      Either K independent *paths* from the same question (diversity from per-path seeds,
         temperature, or per-path instructions), or a *plan*: the model first writes a short
         numbered outline of independent sub-tasks and each item becomes a path.
Process  Every path decodes together over the shared question (and plan) in ONE cache, each
         stopping on its own (EOS, a stop string, its token budget).
Reduce   `reencode` (default, exact): the paths' texts go into one conclusion prompt that starts
         with the question (and plan); it is tokenized whole and only its new tokens are fed,
         hanging off the cached prefix, so the conclusion is exactly what the model writes for
         that prompt alone.
         `attend` (approximate, opt-in): Multiverse-style. The conclusion prompt attends directly
         to every path's cached tokens at position max-depth + 1, with nothing re-encoded. An
         unmodified model was never trained to read several branches at once, so this is NOT what
         the model would write for any single prompt; its branch is announced with exact=False.
         `vote`: a final answer is extracted from each path (`extract_answer`) and the majority
         is reported in a Note, with no conclusion decode (unless a merge is also asked for).

The prompts, each rendered as a chat conversation (or plain text for models without a chat
template) and tokenized WHOLE:

    paths:      user: QUESTION [\\n\\n INSTRUCTION] \\n\\n REASONING_INSTRUCTION
    plan:       user: QUESTION \\n\\n PLAN_INSTRUCTION
    plan path:  user: (the plan prompt) / assistant: PLAN / user: ITEM_TEMPLATE [...] REASONING_INSTRUCTION
    conclusion: user: QUESTION \\n\\n CONCLUSION_TEMPLATE                       (paths)
                user: (the plan prompt) / assistant: PLAN / user: CONCLUSION_TEMPLATE (plan)

Path i gets seed key i, so with a fixed seed its tokens are the same whether 1, 4 or 8 paths run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from mdcli.constraints import compile_for
from mdcli.core.decoding import BranchSpec, Decoder, Independent
from mdcli.core.forest import stack_rows
from mdcli.core.steps import StepLoop
from mdcli.errors import ContextTooLongError
from mdcli.events import BranchInfo, Event, Finish, Fork, Note
from mdcli.strategies.job import RunOptions, run_options
from mdcli.strategies.memory import check_forest_fits
from mdcli.strategies.think.job import CONCLUSION_SEED_KEY, Think
from mdcli.strategies.think.text import (
    ATTEND_INSTRUCTION,
    after_answer_token_ids,
    extract_answer,
    majority_vote,
    parse_plan,
)

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel


PLAN_ITEM_TOKENS = 64
"""A plan item's text and the template around it in a path's prompt, for the memory estimate (generous)."""


# -- the run ------------------------------------------------------------------------------------


@dataclass
class _Path:
    info: BranchInfo
    finish: Finish | None = None

    @property
    def text(self) -> str:
        return self.finish.text if self.finish is not None else ""


class ThinkRun:
    """One `think` run over one engine: plan (optional), paths, then vote and/or merge.

    A single Run serves every phase, so the question, the plan and the paths stay in one cache
    and each later phase reuses what is already there; the attend merge is one more step loop
    over it, started at an explicit depth.
    """

    def __init__(
        self,
        model: LoadedModel,
        job: Think,
        options: RunOptions | None = None,
        **engine,
    ):
        self.model = model
        self.job = job
        self.tokenizer = model.tokenizer
        options = run_options(options, engine, every=True)
        if job.merge == "attend":  # it reads every path's cached tokens: none may be compacted away meanwhile
            options = options.model_copy(update={"compact_ratio": math.inf})
        self.run = options.run(model)
        self.engine = self.run.engine
        self.decoder = Decoder(self.run, model.tokenizer, model.eos_token_ids)

    def events(self) -> Iterator[Event]:
        self._check_question_fits()
        self._check_paths_fit()
        plan_text, paths = yield from self._map()
        yield from self._decode_paths(paths)
        if self.job.vote:
            yield self._vote(paths)
        if self.job.merge == "reencode":
            yield from self._merge_by_reencoding(paths, plan_text)
        elif self.job.merge == "attend":
            yield from self._merge_by_attending(paths)
        yield self.run.done()

    # -- map -----------------------------------------------------------------------------------

    def _check_question_fits(self) -> None:
        """A question too long for the context fails here, before anything is shown."""
        limit = self.model.context_length
        first = self.job.plan_prompt_ids(self.tokenizer) if self.job.plan else self.job.path_prompt_ids(self.tokenizer, 0)
        if limit is not None and len(first) >= limit:
            raise ContextTooLongError(
                f"the question's prompt is {len(first)} tokens, {len(first) - limit + 1} more than the "
                f"model's context of {limit} allows",
                fix="shorten the question, or use a model with a longer context",
            )

    def _check_paths_fit(self) -> None:
        """Refuse, before any prompt of a path is built, paths whose cache and scores cannot fit
        (as beam refuses a width): the paths share their question's tokens; each adds its own
        instruction (or its plan item, after a plan of up to plan_tokens) and its new tokens."""
        job = self.job
        question = job.plan_prompt_ids(self.tokenizer) if job.plan else job.path_prompt_ids(self.tokenizer, 0)
        own = max((len(job.path_prompt_ids(self.tokenizer, i)) - len(question)
                   for i in range(min(len(job.path_instructions), job.paths))), default=0)
        paths = max(job.paths, job.max_paths) if job.plan else job.paths
        if job.plan:
            own = max(own, 0) + job.plan_tokens + PLAN_ITEM_TOKENS
        check_forest_fits(
            self.model, prompt_tokens=len(question) + paths * max(own, 0), branches=paths,
            new_tokens=job.max_new_tokens, what=f"{{paths}} {job.paths}" + (" (or {max_paths})" if job.plan else ""),
            fix="lower {paths} or {max_new_tokens}" + (" or {max_paths}" if job.plan else ""),
        )

    def _map(self) -> Iterator[Event]:
        """Announce the paths: straight from the question, or one per item of a plan."""
        if not self.job.plan:
            infos = yield from self._announce_plain_paths(start=True)
            return None, [_Path(info) for info in infos]
        plan = yield from self._write_plan()
        items = parse_plan(plan.text, self.job.max_paths)
        if items is None:
            yield Note(
                kind="plan-fallback",
                message=f"could not find a numbered outline in the plan; running {self.job.paths} plain paths instead",
                data={"plan": plan.text, "paths": self.job.paths},
            )
            infos = yield from self._announce_plain_paths(start=False)
            return None, [_Path(info) for info in infos]
        yield Note(kind="plan", message=f"{_plural(len(items), 'sub-task')}, one path each", data={"items": items})
        specs = [self.job.path_spec(self.tokenizer, i, plan.text, item) for i, item in enumerate(items)]
        infos = self._announce(specs)
        for info in infos:  # each path reads the plan: show it under the plan
            yield Fork(branch=replace(info, parent=plan.branch))
        return plan.text, [_Path(info) for info in infos]

    def _announce_plain_paths(self, *, start: bool) -> Iterator[Event]:
        """K paths from the question alone: in the Start event, or as Forks after a failed plan."""
        specs = [self.job.path_spec(self.tokenizer, i) for i in range(self.job.paths)]
        infos = self._announce(specs)
        if start:
            yield self._start(infos)
        else:
            for info in infos:
                yield Fork(branch=info)
        distinct = len({tuple(spec.prompt_ids) for spec in specs})
        if self.job.sampling.greedy and distinct < len(specs):
            yield Note(
                kind="identical-paths",
                message=f"greedy decoding: the {len(specs)} paths have only {distinct} distinct prompts, so "
                "paths with the same prompt will be identical; use --temperature (with --seed) or "
                "--path-instruction for diverse paths",
                data={"paths": len(specs), "distinct_prompts": distinct},
            )
        return infos

    def _write_plan(self) -> Iterator[Event]:
        [info] = self._announce([self.job.plan_spec(self.tokenizer)])
        yield self._start([info])
        plan = None
        for event in self.decoder.decode("plan"):
            yield event
            if isinstance(event, Finish):
                plan = event
        return plan

    def _start(self, infos: list[BranchInfo]):
        return self.run.start("think", self.job.sampling.seed, infos)

    def _announce(self, specs: list[BranchSpec]) -> list[BranchInfo]:
        return self.decoder.announce(specs)

    # -- process -------------------------------------------------------------------------------

    def _decode_paths(self, paths: list[_Path]) -> Iterator[Event]:
        by_id = {path.info.id: path for path in paths}
        for event in self.decoder.decode("paths"):
            yield event
            if isinstance(event, Finish) and event.branch in by_id:
                by_id[event.branch].finish = event

    # -- reduce --------------------------------------------------------------------------------

    def _vote(self, paths: list[_Path]) -> Note:
        answers = {
            f"path {i}": extract_answer(path.text, self.job.answer_pattern, question=self.job.question)
            for i, path in enumerate(paths, 1)
        }
        note = majority_vote(answers).note()
        constraint = self.job.path_constraint()
        note.data["constraint"] = None if constraint is None else constraint.describe()  # the paths decoded under it
        return note

    def _merge_by_reencoding(self, paths: list[_Path], plan_text: str | None) -> Iterator[Event]:
        """Exact: one conclusion prompt, tokenized whole; only the tokens after the cached
        question (and plan) are fed, in one prefill, and the engine's count proves it."""
        spec = self.job.conclusion_spec(self.tokenizer, [p.text for p in paths], plan_text)
        reused, _ = self.engine.forest.longest_cached_prefix(spec.prompt_ids, limit=len(spec.prompt_ids) - 1)
        try:
            [info] = self._announce([spec])
        except ContextTooLongError as error:
            yield _skipped_merge_note("reencode", error.problem)
            return
        fed_before = self.decoder.stats(0).prefill_tokens
        yield Fork(branch=info)
        yield from self.decoder.decode("conclusion")
        fed = self.decoder.stats(0).prefill_tokens - fed_before
        message = (
            f"reencode: the conclusion prompt is {len(spec.prompt_ids)} tokens; {reused} were already cached "
            f"(question{' and plan' if plan_text is not None else ''}), {fed} new ones were fed"
        )
        if fed != len(spec.prompt_ids) - reused:  # the engine's own count disagrees with the plan
            message += f" (expected {len(spec.prompt_ids) - reused})"
        yield Note(
            kind="merge",
            message=message,
            data={"mode": "reencode", "prompt_tokens": len(spec.prompt_ids), "reused_tokens": reused, "fed_tokens": fed},
        )

    def _merge_by_attending(self, paths: list[_Path]) -> Iterator[Event]:
        """Approximate, Multiverse-style: the conclusion attends to the union of every path's
        cached tokens (and the question) at position max-depth + 1; nothing is re-encoded. One
        tip started at that explicit row and depth, decoded by the step loop on its own."""
        started = time.perf_counter()
        counters = self.run.counters
        fed_before = counters.prefill_tokens
        rows = self._closed_path_rows(paths)  # [P, N]
        union = rows.any(0)  # [N]
        depth = int(rows.sum(-1).max())  # the deepest path's next position
        chain = after_answer_token_ids(self.tokenizer, ATTEND_INSTRUCTION, chat_template=self.job.chat_template)
        budget = self._attend_budget(depth + len(chain))
        if budget < 1:
            yield _skipped_merge_note("attend", f"the paths already fill the model's context of {self.model.context_length}")
            return
        loop = StepLoop(self.run, Independent(phase=None), self.tokenizer, self.model.eos_token_ids)
        tip = loop.tip(
            "conclusion (approximate)",
            self.engine.forest.path_token_ids(union) + chain,  # in cache order, not a sequence
            sampling=self.job.sampling, seed_key=CONCLUSION_SEED_KEY, max_new_tokens=budget, stop=self.job.stop,
            fit=False, counted=False, constraint=compile_for(self.job.constraint, self.tokenizer),
        )
        tip.exact = False
        yield Fork(branch=tip.info())
        yield Note(
            kind="approximate",
            message=f"--merge attend: the conclusion reads all {len(paths)} paths at once from position {depth} "
            "without re-encoding them; the model was not trained for this, so it is not what the model would "
            "write for any single prompt (use --merge reencode for the exact conclusion)",
            data={"mode": "attend", "start_depth": depth, "fed_tokens": counters.prefill_tokens - fed_before + len(chain)},
        )
        loop.start_at(tip, union, chain, depth)
        decoding = counters.decode_seconds
        yield from loop.run_tips([tip])
        counters.decode_seconds = decoding + time.perf_counter() - started

    def _closed_path_rows(self, paths: list[_Path]) -> torch.Tensor:
        """[P, N] bool: each path's cached tokens, its final token included.

        A branch's last token is never fed (nothing needed its logits). Paths that ended on EOS
        leave it out (the merge chain supplies the end of turn); the others get it fed now, in one
        forward, so the conclusion sees every word of every path.
        """
        rows, tails = [], []
        for path in paths:
            tokens = path.finish.token_ids if path.finish is not None else []
            fed = path.info.prompt_token_ids + tokens[:-1]
            rows.append(self._cached_row(fed))
            if tokens and tokens[-1] not in self.model.eos_token_ids:
                tails.append((len(rows) - 1, tokens[-1]))
        if tails:
            stacked = stack_rows([rows[i] for i, _ in tails], len(self.engine))
            outs = self.engine.forward(stacked, [[token] for _, token in tails], logits=False)
            for (i, _), out in zip(tails, outs):
                rows[i] = out.row
            self.run.counters.prefill_tokens += len(tails)
        return stack_rows(rows, len(self.engine))  # [P, N]

    def _cached_row(self, sequence: list[int]) -> torch.Tensor:
        """The ancestor row of a cached node whose path is `sequence` (any such node will do: its
        keys and values depend only on its path).

        Walked level by level over every cached node, not through the forest's (parent, token)
        index: paths that sampled the same first tokens hold duplicate nodes, the index keeps only
        the first of them, and a path's later tokens may hang under another duplicate.
        """
        forest = self.engine.forest
        frontier = torch.tensor([-1], device=forest.device)  # [F] slots whose path is the prefix so far
        for depth, token in enumerate(sequence):
            hits = (forest.tokens == token) & (forest.depth == depth) & torch.isin(forest.parent, frontier)  # [N]
            frontier = hits.nonzero().flatten()
            if frontier.numel() == 0:
                raise RuntimeError(f"a path's tokens are no longer cached ({depth} of {len(sequence)} found)")
        return forest.row_of(int(frontier[0]))

    def _attend_budget(self, first_free_position: int) -> int:
        limit = self.model.context_length
        if limit is None:
            return self.job.conclusion_tokens
        return min(self.job.conclusion_tokens, limit - first_free_position)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _skipped_merge_note(mode: str, why: str) -> Note:
    return Note(kind="merge-skipped", message=f"no conclusion ({mode}): {why}", data={"mode": mode, "reason": why})


def run_think(model: LoadedModel, job: Think, options: RunOptions | None = None, **engine) -> Iterator[Event]:
    """The events of a think run (validate `job` first to fail before any output); `options` (or
    RunOptions' fields as keywords): how the engine runs; think honours them all."""
    return ThinkRun(model, job, options, **engine).events()
