"""explore: step-level search ("generate k parallel thoughts, then choose between them"), a policy
over the step loop (mdcli/core/steps.py) and nothing else.

A *step* is a piece of the answer: up to the end of a sentence or a line (the default; a step
that has not ended after SENTENCE_CAP tokens ends there), or exactly `chunk_tokens` tokens. Each
round:

1. every kept path forks `k` *candidates* (`loop.fork`), which sample their next step together in
   one forest: one engine forward per token for all of them;
2. a candidate that reaches the step boundary, EOS or the -n budget waits (`loop.wait`) for its
   siblings;
3. when all have stopped, each is scored: `logprob`, the mean logprob of the step's tokens; or
   `judge`, the model's own verdict: a judge branch is forked from the candidate with a rating
   question as its continuation (`RATING_QUESTION`, fed as one chain in the same forest) and its
   score is logit("Yes") - logit("No") for its first answer token;
4. candidates are ranked by score, best first, ties to the lower candidate index. If the best one
   ended (EOS or -n), the search is over: its path is the answer. Otherwise the best `keep` that
   can go on are kept: each feeds its last token and forks the next round's k candidates; the
   others are pruned, and the cache reclaims their slots (compaction).

Events (the JSONL contract):

* Start announces one branch, "explore": the prompt.
* every candidate is a `fork` (label "step R #I": round R, candidate I from 1; its
  prompt_token_ids are the prompt + the path chosen so far) followed by its `token`s;
* every candidate ends in a `prune` whose reason holds its score and rank:
  "outscored: score -0.8123 (rank 3 of 4)" for those not kept, "kept: score ..." for those
  kept (pruned once their own candidates are forked: their text lives on in them), "ended: score
  ..." for one that ended (EOS, -n) while a better one goes on;
* with `judge`, each judge is a `fork` (label "judge R #I") and a `prune` ("rated: score +1.2345");
* the chosen path is the final `finish`, on the Start branch: its token_ids are the whole answer
  (exactly what the prompt generates through the chosen steps), its text decoded whole.

Exactness and seeds: candidate I of every round draws from generator I (key I - 1), seeded once
from (seed, I - 1) and continuing where candidate I of the previous round stopped. So every
candidate's tokens are what sampling its prompt alone gives with that generator, and with k = 1
the one generator runs through the whole answer: the answer is plain decoding of the prompt with
seed key 0 (greedy: `model.generate`; sampled: ask-many's single branch with that seed).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from mdcli.constraints import Constraint, compile_for
from mdcli.errors import UsageError
from mdcli.events import BranchInfo, Event, Finish, Progress, Prune
from mdcli.strategies.prompts import continuation_token_ids, prompt_token_ids
from mdcli.core.run import Run
from mdcli.core.sampling import Sampler, SamplingParams
from mdcli.core.steps import Policy, StepLoop, Tip
from mdcli.strategies.job import FieldError, Job, Options, RunOptions, run_options

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel

SCORES = ("logprob", "judge")
DEFAULT_TEMPERATURE = 0.8  # k greedy candidates would all be the same
SENTENCE_CAP = 64  # a step that has not ended a sentence or line after this many tokens ends here
RATING_QUESTION = "Is the last sentence of your answer correct and helpful? Answer Yes or No."
_CLOSERS = "\"')]*_`\u201d\u2019"


class ExploreOptions(Options):
    """explore's parameters: the job's and the recipe's (mdcli/recipes/explore.py) alike."""

    k: int = Field(4, ge=1)  # candidates per kept path at each step
    keep: int = Field(1, ge=1)  # paths kept after each step (at most k)
    chunk_tokens: int | None = Field(None, ge=1)  # None: a step ends at the end of a sentence or line
    score: Literal["logprob", "judge"] = "logprob"
    constraint: Constraint | None = None  # the answer's shape: every candidate continues its path under it


class Explore(Job, ExploreOptions):
    """One explore job: the prompt and the search's settings (checked by `validate`)."""

    prompt: str
    system: str | None = None
    chat_template: bool = True
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(temperature=DEFAULT_TEMPERATURE))
    max_new_tokens: int = Field(256, ge=1)

    @classmethod
    def problem(cls, name: str, value: Any, data: dict[str, Any], message: str) -> FieldError:
        if name == "k":
            return FieldError(f"{{k}} {value}: explore needs at least 1 candidate per step", fix="use {k} 1 or more")
        if name == "keep":
            return _keep_problem(value, data.get("k", cls.model_fields["k"].default))
        if name == "chunk_tokens":
            return FieldError(
                f"{{chunk_tokens}} {value} must be at least 1",
                fix="give a positive number, or leave it out to end steps at sentences and lines",
            )
        if name == "score":
            return FieldError(f"unknown {{score}} '{value}'", fix=f"use one of: {', '.join(SCORES)}")
        if name == "max_new_tokens":
            return FieldError("{max_new_tokens} must be at least 1", fix="use a positive number")
        return super().problem(name, value, data, message)

    def validate(self) -> None:
        if not self.prompt.strip():
            raise UsageError("the prompt is empty", fix="give some text, a file, or - for stdin")
        if self.keep > self.k:
            raise _keep_problem(self.keep, self.k)


def _keep_problem(keep: Any, k: Any) -> FieldError:
    return FieldError(
        f"{{keep}} {keep} must be between 1 and {{k}} ({k})",
        fix="keep at most as many paths as there are candidates per step",
    )


def ends_step(text: str, tokens: int, chunk_tokens: int | None) -> bool:
    """Whether a candidate with this text (its `tokens` tokens decoded) has finished its step."""
    if chunk_tokens is not None:
        return tokens >= chunk_tokens
    if tokens >= SENTENCE_CAP:
        return True
    body = text.rstrip(" \t")
    if not body.strip():
        return False  # nothing but blanks yet: a step says something
    if body.endswith("\n"):
        return True
    body = body.rstrip(_CLOSERS)
    if body.endswith(("!", "?")):
        return True
    # "3." in "3.14" or a numbered list item is not the end of a sentence
    return body.endswith(".") and not (len(body) >= 2 and body[-2].isdigit())


@dataclass
class _Role:
    """What a tip is to the search (tip.data)."""

    kind: str  # "root" | "candidate" | "judge"
    index: int = 0  # candidate: lane (0-based); judge: its candidate's
    round: int = 0
    done: str | None = None  # candidate: "boundary" | "stop" | "length" once it has stopped
    score: float | None = None
    judged: bool = False
    candidate: Tip | None = None  # judge: whose step it rates
    verdict: str = ""  # candidate kept: its prune reason, given once its children are forked
    path: list[int] = field(default_factory=list)  # tokens chosen before this candidate's step
    path_logprob: float = 0.0


class ExploreSearch(Policy):
    """The explore policy over one Run: `announce()` for Start's branches, then iterate `run()`."""

    def __init__(self, run: Run, job: Explore, tokenizer, eos_token_ids: frozenset[int]) -> None:
        job.validate()
        self.job = job
        self.loop = StepLoop(run, self, tokenizer, eos_token_ids)
        ids = prompt_token_ids(tokenizer, job.prompt, system=job.system, chat_template=job.chat_template)
        self.rating_ids, self.yes_no = _rating(tokenizer, job.chat_template) if job.score == "judge" else ([], (0, 0))
        # a judge reads the whole answer and its rating question: the budget leaves room for both
        budget = run.fit("explore", len(ids) + len(self.rating_ids), job.max_new_tokens)
        self.root = self.loop.tip("explore", ids, max_new_tokens=budget, fit=False, data=_Role("root"),
                                  constraint=compile_for(job.constraint, tokenizer))
        self.root.asked_new_tokens = job.max_new_tokens
        self.lanes: dict[int, Sampler] = {}
        self.parents: list[Tip] = [self.root]  # kept paths, best first, that fork next
        self.candidates: list[Tip] = []  # this round's, by index
        self.round = 0

    def announce(self) -> list[BranchInfo]:
        return [self.root.info()]

    def run(self) -> Iterator[Event]:
        yield from self.loop.capped_notes([self.root])
        yield from self.loop.prefill([self.root], "prefill")
        yield from self.loop.run_tips([self.root])

    # -- the policy ----------------------------------------------------------------------------

    def step(self, loop: StepLoop, tips: list[Tip]) -> Iterator[Event]:
        """One verb per tip: judges with logits are read and pruned; kept paths whose last token
        is now cached fork the next round (and are pruned: their text lives on in the children);
        going candidates take a token and are fed, unless it stopped them; stopped candidates
        wait for their siblings, then for their judges, then are kept (fed their last token) or
        pruned."""
        judges = [t for t in tips if t.data.kind == "judge"]
        for judge in judges:
            yield self._rate(loop, judge)
        if self.parents and any(t is self.parents[0] for t in tips):  # kept paths with logits
            yield from self._fork_round(loop)
        going = [t for t in self.candidates if t.data.done is None]
        if going:
            for tip, token, logprob in zip(going, *loop.choose(going)):
                event, reason = loop.accept(tip, token, logprob)
                yield event
                if reason is not None:
                    tip.data.done = reason
                elif ends_step(tip.detok.text, len(tip.tokens), self.job.chunk_tokens):
                    tip.data.done = "boundary"
                else:
                    loop.feed(tip, [token])
        if any(t.data.done is None for t in self.candidates):
            waiting = [t for t in self.candidates if t.data.done is not None]
        elif self.job.score == "judge" and not all(t.data.judged for t in self.candidates):
            if not judges:  # every candidate has stopped: rate them all in this step's forward
                yield from self._fork_judges(loop)
            waiting = self.candidates
        else:
            yield from self._settle(loop)
            return
        for tip in waiting:
            loop.wait(tip)

    def progress(self, loop: StepLoop) -> Progress | None:
        if not loop.live:  # the answer is out: nothing comes between it and Done
            return None
        return Progress("explore decode", self.round - 1, self.round, "steps")

    # -- a round -------------------------------------------------------------------------------

    def _fork_round(self, loop: StepLoop) -> Iterator[Event]:
        """Each kept path (best first) forks k candidates, which decide their first token now."""
        self.round += 1
        self.candidates = []
        sampling = self.job.sampling
        for rank, parent in enumerate(self.parents):
            role: _Role = parent.data
            path = role.path + list(parent.tokens)
            path_logprob = role.path_logprob + (parent.logprob if role.kind == "candidate" else 0.0)
            for c in range(self.job.k):
                index = rank * self.job.k + c
                child, fork = loop.fork(
                    parent, f"step {self.round} #{index + 1}", max_new_tokens=self.root.max_new_tokens - len(path),
                    counted=False, data=_Role("candidate", index, self.round, path=path, path_logprob=path_logprob),
                    continues=parent.constraint,  # a copy of the path's constraint state, if any
                )
                if index not in self.lanes:  # one generator per candidate index, for the whole run
                    self.lanes[index] = Sampler(sampling, index, loop.engine.device)
                child.sampler = self.lanes[index]
                self.candidates.append(child)
                yield fork
            if role.kind == "candidate":
                yield loop.prune(parent, role.verdict)

    def _fork_judges(self, loop: StepLoop) -> Iterator[Event]:
        for tip in self.candidates:
            rating = list(self.rating_ids)
            if tip.data.done == "stop" and tip.tokens and rating and tip.tokens[-1] == rating[0]:
                rating = rating[1:]  # the step already closed the turn (EOS is the turn's end)
            role = _Role("judge", tip.data.index, self.round, candidate=tip)
            _, fork = loop.fork(tip, f"judge {self.round} #{tip.data.index + 1}", rating, max_new_tokens=1,
                                counted=False, data=role)
            yield fork

    def _rate(self, loop: StepLoop, judge: Tip) -> Prune:
        """A judge's first-token logits: score = logit(Yes) - logit(No)."""
        yes, no = self.yes_no
        score = float(judge.logits[yes] - judge.logits[no])
        candidate = judge.data.candidate
        candidate.data.score, candidate.data.judged = score, True
        return loop.prune(judge, f"rated: score {score:+.4f}")

    def _settle(self, loop: StepLoop) -> Iterator[Event]:
        """Every candidate has stopped and is scored: rank them, keep the best, or end."""
        for tip in self.candidates:
            if self.job.score == "logprob":
                tip.data.score = tip.logprob / len(tip.tokens)
        ranked = sorted(self.candidates, key=lambda t: (-t.data.score, t.data.index))
        best = ranked[0]
        final = best.data.done != "boundary"
        kept = [] if final else [t for t in ranked if t.data.done == "boundary"][: self.job.keep]
        for rank, tip in enumerate(ranked, 1):
            tip.data.verdict = f"score {tip.data.score:+.4f} (rank {rank} of {len(ranked)})"
        for tip in self.candidates:  # events in candidate order
            role: _Role = tip.data
            if tip in kept:
                role.verdict = f"kept: {role.verdict}"
                loop.feed(tip, [tip.tokens[-1]])  # its children hang off its whole step
            elif tip is best and final:
                yield loop.prune(tip, f"kept: {role.verdict}")
            else:
                word = "outscored" if role.done == "boundary" else "ended"
                yield loop.prune(tip, f"{word}: {role.verdict}")
        self.parents = kept
        if final:
            yield self._answer(loop, best)

    def _answer(self, loop: StepLoop, best: Tip) -> Finish:
        """The Start branch finishes with the chosen path: every chosen step, decoded whole."""
        root = self.root
        for token in best.data.path + list(best.tokens):
            root.detok.add(token)
        root.logprob = best.data.path_logprob + best.logprob
        root.constraint = best.constraint  # where the chosen path stands in the constraint
        return loop.finish(root, best.data.done)


def _rating(tokenizer, chat_template: bool) -> tuple[list[int], tuple[int, int]]:
    """The judge's continuation and its (Yes, No) token ids: in a chat, a new user turn asking
    RATING_QUESTION and the assistant header (the answer's first token is "Yes" or "No"); for a
    plain model, the question and "Answer:" (then " Yes" or " No")."""
    chat = chat_template and getattr(tokenizer, "chat_template", None)
    text = RATING_QUESTION if chat else RATING_QUESTION + "\nAnswer:"
    ids = continuation_token_ids(tokenizer, text, chat_template=bool(chat))
    words = ("Yes", "No") if chat else (" Yes", " No")
    yes, no = (tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words)
    return ids, (yes, no)


# What explore cannot honour of RunOptions, and why (RunOptions.refuse).
REFUSES = {"speculate": "its candidates stop at every step to be ranked"}


def run_explore(model: LoadedModel, job: Explore, options: RunOptions | None = None, **engine) -> Iterator[Event]:
    """The events of an explore run: Start, the search, Done (over one Run). `options` (or
    RunOptions' fields as keywords): how the engine runs; speculation is refused (REFUSES), here,
    before the first event."""
    options = run_options(options, engine, every=True).refuse("explore", **REFUSES)
    return _explore_events(model, job, options)


def _explore_events(model: LoadedModel, job: Explore, options: RunOptions) -> Iterator[Event]:
    run = options.run(model)
    search = ExploreSearch(run, job, model.tokenizer, model.eos_token_ids)
    yield run.start("explore", job.sampling.seed, search.announce())
    yield from search.run()
    yield run.done()

