"""--each on a Ray cluster: N actors, each loading the model once, pulling chunks of documents.

The driver (this process) reads the documents, skips those the results file already holds and
keeps the one queue of chunks still to answer. Each actor (`EachWorker`) holds at most one chunk
at a time and is handed the next as soon as it returns one, so a fast actor takes more; it
answers its chunk with strategies.each.run_each (its own forests, the same tokens as one
process) and returns every document whole. Only the driver writes results, so a document is
written once: an actor that dies (killed, out of memory, its node gone) returns nothing, its chunk
goes back to the front of the queue and a new actor takes its place. A chunk that has killed
`MAX_ATTEMPTS` actors is given up: each of its documents becomes an error record.

`--workers N` starts a local Ray cluster of N CPUs (or uses the one this process already joined);
`--ray-address ADDR` joins an existing cluster, where mdcli and its model must be installed on
every node, with N actors or, without --workers, one per CPU of the cluster.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterator

from mdcli.documents.inputs import Document, Inputs
from mdcli.errors import MdcliError
from mdcli.events import DocumentDone, DocumentRef, Event, Note, Progress
from mdcli.models.load import LoadOptions, load_model
from mdcli.strategies.ask_many import AskMany
from mdcli.strategies.each import document_sha256, entry_key, input_places, job_options, model_identity, run_each
from mdcli.strategies.job import RunOptions

try:  # the optional extra: without it, --workers says how to install it (cli/each.py)
    import ray
    import ray.exceptions
except ImportError:
    ray = None

MAX_ATTEMPTS = 3  # actors a chunk may take down before its documents are given up
MAX_CHUNK_DOCUMENTS = 32  # a chunk: enough documents to fill a forest, few enough to share the work


def available() -> bool:
    """Whether Ray is installed."""
    return ray is not None


class EachWorker:
    """One Ray actor: the model loaded once, then chunks of documents answered as asked."""

    def __init__(self, options: LoadOptions) -> None:
        self.model = load_model(options)

    def identity(self) -> str:
        return model_identity(self.model)

    def answer(self, chunk: list[tuple[int, Document]], job: AskMany, engine: dict) -> list[DocumentDone]:
        """Every document of `chunk` (its input place, the document) answered, in finishing order."""
        events = run_each(self.model, job, [document for _, document in chunk], indices=[i for i, _ in chunk], **engine)
        return [event for event in events if isinstance(event, DocumentDone)]


class RayEach:
    """The driver: the queue, the actors, the results as events (module docstring)."""

    def __init__(self, options: LoadOptions, job: AskMany, inputs: Inputs, *, answered: set[str] | frozenset[str] = frozenset(),
                 workers: int | None = None, address: str | None = None, budget_tokens: int | None = None,
                 run_options: RunOptions | None = None, chunk_documents: int | None = None) -> None:
        if ray is None:
            raise MdcliError("Ray is not installed", fix='pip install "mdcli[ray]"')
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=address, num_cpus=None if address is not None else (workers or 1), include_dashboard=False,
                     log_to_driver=False, logging_level=logging.ERROR)
        if workers is None:  # --ray-address alone: an actor per CPU of the cluster
            workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.options = options.model_copy(update={"progress": None, "quiet": True})
        self.job, self.inputs, self.answered = job, inputs, answered
        self.workers, self.chunk_documents = workers, chunk_documents
        self.engine = {"budget_tokens": budget_tokens, "options": run_options or RunOptions()}  # each chunk's run
        self.actor_class = ray.remote(num_cpus=1)(EachWorker)
        self.actors = [self.actor_class.remote(self.options) for _ in range(workers)]

    def events(self) -> Iterator[Event]:
        try:
            yield from self._events()
        finally:
            for actor in self.actors:
                ray.kill(actor)
            if self.started_ray:
                ray.shutdown()

    def _events(self) -> Iterator[Event]:
        try:
            identity = self._get(self.actors[0].identity.remote())
        except ray.exceptions.RayActorError as error:  # the model did not load in the actor
            raise MdcliError(f"a Ray worker could not load the model: {_cause(error)}",
                             fix="check that the same command without --workers loads it") from None
        options = job_options(self.job)
        todo, already = [], 0
        places, skipped_places = input_places(len(self.inputs.documents), self.inputs.skipped)
        for place, document in zip(places, self.inputs.documents):
            key = entry_key(document.path, document_sha256(document.text), options, identity)
            if key in self.answered:
                already += 1
            else:
                todo.append((place, document))
        refused = [DocumentDone(DocumentRef(s.path, None), place, [], error=f"skipped: {s.reason}")
                   for place, s in zip(skipped_places, self.inputs.skipped)]
        total, done = len(todo) + len(refused), 0
        if already:
            yield Note("each", f"{already} of {already + total} documents already answered in the output: skipped",
                       {"skipped": already, "documents": already + total})
        yield Progress("documents", 0, total, "documents")
        for event in refused:
            done += 1
            yield event
            yield Progress("documents", done, total, "documents")
        size = self.chunk_documents or max(1, min(MAX_CHUNK_DOCUMENTS, math.ceil(len(todo) / (4 * self.workers))))
        queue = deque((todo[i:i + size], 0) for i in range(0, len(todo), size))
        in_flight: dict = {}
        idle = list(self.actors)
        while queue or in_flight:
            while queue and idle:
                actor = idle.pop()
                chunk, attempts = queue.popleft()
                in_flight[actor.answer.remote(chunk, self.job, self.engine)] = (actor, chunk, attempts)
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            actor, chunk, attempts = in_flight.pop(ready[0])
            try:
                results = self._get(ready[0])
                idle.append(actor)
            except ray.exceptions.RayActorError:
                idle.append(self._replace(actor))
                if attempts + 1 < MAX_ATTEMPTS:
                    queue.appendleft((chunk, attempts + 1))
                    yield Note("worker", f"a worker died; its {len(chunk)} documents run again on another",
                               {"documents": [document.path for _, document in chunk]})
                    continue
                results = [self._given_up(place, document) for place, document in chunk]
            for event in results:
                done += 1
                yield event
                yield Progress("documents", done, total, "documents")

    def _replace(self, dead) -> object:
        """A new actor in the place of one that died."""
        ray.kill(dead)
        fresh = self.actor_class.remote(self.options)
        self.actors = [fresh if actor is dead else actor for actor in self.actors]
        return fresh

    def _given_up(self, place: int, document: Document) -> DocumentDone:
        return DocumentDone(DocumentRef(document.path, document_sha256(document.text)), place, [],
                            error=f"{MAX_ATTEMPTS} workers died answering it")

    @staticmethod
    def _get(ref):
        """ray.get, an mdcli error raised in an actor raised here as itself (one line, its exit code)."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            cause = error.as_instanceof_cause()
            if isinstance(cause, MdcliError):
                kind = next(k for k in type(cause).__mro__ if k.__module__ == MdcliError.__module__)
                raise kind(cause.problem, fix=cause.fix) from None
            raise


def _cause(error: Exception) -> str:
    """The last line of an actor's failure that says something (the exception raised in it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    told = [line for line in lines if "Error" in line.split(":", 1)[0]]
    last = (told or lines or [type(error).__name__])[-1]
    if last.startswith("mdcli.errors."):  # one of mdcli's own one-line errors: its words alone
        last = last.split(": ", 1)[-1]
    return last[:300]


def ask_each_on_ray(options: LoadOptions, job: AskMany, inputs: Inputs, **settings) -> Iterator[Event]:
    """run_each's events, the documents answered by Ray actors (RayEach's arguments)."""
    return RayEach(options, job, inputs, **settings).events()


__all__ = ["EachWorker", "RayEach", "ask_each_on_ray", "available"]
