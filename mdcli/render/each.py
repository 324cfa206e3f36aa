"""--each output: one block or record per (document, question), a results file, progress.

* plain: `## path :: question`, the answer (" …" when -n cut it), a blank line; a document's
  answers are printed together as soon as it is finished;
* jsonl: one `answer` record per (document, question), each carrying `document` {path, sha256}
  and the `key` a rerun matches; one `error` record per document that could not run;
* json: one document at the end, `documents` in input order, each with its answers or its error.

A results file (`--output FILE.jsonl`) gets the jsonl records of each finished document in one
write, flushed at once: a kill loses at most the documents in flight. `answered_keys` reads back
what a rerun skips. Every document that could not run is one line on stderr too.

Progress (stderr): documents done of all, the rate and an ETA; on a terminal one line rewritten
in place, elsewhere (with --progress) one line every few seconds; never with --quiet.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from mdcli.errors import UsageError
from mdcli.events import DocumentDone, Event, Note, Progress

CUT_MARK = " …"
LINE_INTERVAL_SECONDS = 3.0


def document_records(event: DocumentDone) -> list[dict]:
    """The jsonl records of one finished document."""
    ref = asdict(event.document)
    if event.error is not None:
        return [{"type": "error", "document": ref, "index": event.index, "error": event.error}]
    return [
        {"type": "answer", "document": ref, "index": event.index, "key": event.key, "question": answer.question,
         "text": answer.text, "token_ids": answer.token_ids, "finish_reason": answer.finish_reason,
         "cumulative_logprob": answer.cumulative_logprob, "parsed": answer.parsed}
        for answer in event.answers
    ]


def answered_keys(path: Path, questions: int) -> set[str]:
    """The keys of the documents `path` holds whole (an `answer` record for each of `questions`
    distinct questions); a line that is not a JSON record (a write cut by a kill) is passed over."""
    if not path.exists():
        return set()
    seen: dict[str, set[str]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read the results file '{path}': {error}", fix="give another --output file") from error
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("type") == "answer" and isinstance(record.get("key"), str):
            seen.setdefault(record["key"], set()).add(str(record.get("question")))
    return {key for key, asked in seen.items() if len(asked) >= questions}


class ResultsFile:
    """Appends each finished document's records to a .jsonl file, whole, and flushes them."""

    def __init__(self, path: Path) -> None:
        try:
            self.file = path.open("a+", encoding="utf-8")
            self.file.seek(0, 2)
            if self.file.tell():  # a line cut by a kill must not swallow the next record
                self.file.seek(self.file.tell() - 1)
                last = self.file.read(1)
                if last != "\n":
                    self.file.write("\n")
        except OSError as error:
            raise UsageError(f"cannot write the results file '{path}': {error.strerror}",
                             fix="check the folder exists and is writable") from error

    def write(self, event: DocumentDone) -> None:
        self.file.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in document_records(event)))
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class EachWriter:
    """Consumes ask_each's events: answers to stdout in `mode` (plain | jsonl | json), errors,
    notes and progress to stderr, every finished document to `results` when given."""

    def __init__(self, mode: str, stdout: TextIO, stderr: TextIO, *, quiet: bool = False, progress: bool = False,
                 header: str | None = None, results: ResultsFile | None = None, terminal: bool = False) -> None:
        self.mode, self.stdout, self.stderr = mode, stdout, stderr
        self.quiet, self.results = quiet, results
        self.lines = progress and not terminal and not quiet
        self.status = terminal and not quiet
        self.started = time.perf_counter()
        self.documents: list[DocumentDone] = []
        self.failed = self.done = self.total = self.answers = 0
        self._shown = 0.0
        self._status_width = 0
        if header and not quiet:
            self._err(header)

    def handle(self, event: Event) -> None:
        if isinstance(event, DocumentDone):
            self._document(event)
        elif isinstance(event, Progress) and event.phase == "documents":
            self.done, self.total = event.done, event.total
            self._progress(final=event.done == event.total)
        elif isinstance(event, Note):
            self._err(event.message)

    def _document(self, event: DocumentDone) -> None:
        if self.results is not None:
            self.results.write(event)
        if event.error is not None:
            self.failed += 1
            self._err(f"{event.document.path}: {event.error}")
        self.answers += len(event.answers)
        if self.mode == "json":
            self.documents.append(event)
            return
        if self.mode == "jsonl":
            text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in document_records(event))
        else:
            text = "".join(
                f"## {event.document.path} :: {answer.question}\n{answer.text}"
                f"{CUT_MARK if answer.finish_reason == 'length' else ''}\n\n"
                for answer in event.answers
            )
        if text:
            self._clear_status()
            self.stdout.write(text)
            self.stdout.flush()

    def _progress(self, final: bool) -> None:
        if not (self.lines or self.status) or self.total == 0 or self.done == 0:
            return
        now = time.perf_counter()
        if self.lines and not final and now - self._shown < LINE_INTERVAL_SECONDS:
            return
        self._shown = now
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else None
        eta = "" if left is None or final else f" · ETA {_duration(left)}"
        line = f"mdcli: {self.done}/{self.total} documents · {rate:.2f} doc/s{eta}"
        if self.status:
            self.stderr.write("\r" + line.ljust(self._status_width))
            self._status_width = len(line)
        else:
            self.stderr.write(line + "\n")
        self.stderr.flush()

    def _clear_status(self) -> None:
        if self.status and self._status_width:
            self.stderr.write("\r" + " " * self._status_width + "\r")
            self.stderr.flush()
            self._status_width = 0

    def _err(self, message: str) -> None:
        self._clear_status()
        self.stderr.write(f"mdcli: {message}\n")
        self.stderr.flush()

    def close(self, interrupted: bool = False) -> None:
        """The json document (documents in input order), the summary line; the results file closed."""
        self._clear_status()
        if self.results is not None:
            self.results.close()
        if self.mode == "json":
            body = {"documents": [_json_document(event) for event in sorted(self.documents, key=lambda e: e.index)]}
            self.stdout.write(json.dumps(body, ensure_ascii=False, indent=2) + "\n")
            self.stdout.flush()
        if not self.quiet:
            seconds = time.perf_counter() - self.started
            failed = f" · {self.failed} failed" if self.failed else ""
            stopped = " · interrupted" if interrupted else ""
            self._err(f"{self.done} of {self.total} documents · {self.answers} answers{failed}{stopped} · {seconds:.1f} s")


def _json_document(event: DocumentDone) -> dict:
    body: dict = {"document": asdict(event.document)}
    if event.error is not None:
        body["error"] = event.error
    else:
        body["answers"] = [
            {"question": a.question, "text": a.text, "finish_reason": a.finish_reason, "parsed": a.parsed}
            for a in event.answers
        ]
    return body


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
