"""A live terminal display: one panel per branch, each showing the newest part of its text.

The display is redrawn by Rich's refresh thread about a dozen times a second, and the frame is
built only then (through `Live(get_renderable=...)`), not per token: a run of many branches
produces hundreds of tokens a second, far more than a terminal can show.

Panels only ever show the tail of each text, so when the run ends the display collapses into a
one-line status per branch and the full answers are printed below it: nothing is lost to
cropping, and the scrollback holds each answer once.
"""

from __future__ import annotations

import errno
import io
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console, Group, RenderableType
from rich.containers import Lines
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from mdcli.events import Done, Event, Finish, Fork, Note, Prune, Start
from mdcli.render.base import (
    BranchBook,
    BranchState,
    Renderer,
    answer_block,
    describe_start,
    interrupted_finishes,
    summary_line,
)
from mdcli.render.progress import ProgressDisplay, ProgressFeed

REFRESH_PER_SECOND = 12
MIN_PANEL_WIDTH = 36
MAX_COLUMNS = 3
MIN_PANEL_HEIGHT = 3  # top border, one line of text, bottom border
PANEL_CHROME_WIDTH = 4  # two borders and one column of padding on each side
PANEL_CHROME_HEIGHT = 2
NOTES_SHOWN = 3
SPARE_LINES = 1  # keeps the cursor line free so a full-height frame does not scroll

# C0 control characters (other than newline and tab) would move the cursor and tear the
# display apart; inside panels they are shown as their Unicode "control pictures" instead.
_CONTROL_PICTURES = {
    code: 0x2400 + code for code in range(32) if chr(code) not in "\n\t"
} | {0x7F: 0x2421}


class _Console(Console):
    """rich's Console, but a closed pipe (`| head`) is the BrokenPipeError every other write of
    mdcli's raises, which the command turns into a quiet exit 0; rich's own answer is exit 1."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more goes to the closed file, not even on the way out
        raise BrokenPipeError(errno.EPIPE, "the output was closed")


PIPED_WIDTH = 100_000
"""The width of a console whose file is not a terminal when it is told not to wrap: no line of
mdcli's is that long, so nothing is cut to rich's default 80 columns in a pipe or a file."""


def make_console(file: TextIO, *, color: bool, wrap_off_a_terminal: bool = True) -> Console:
    """A console on `file`. Without color it emits no styling codes at all (not even bold),
    which is what people who set NO_COLOR expect of a program's output. `wrap_off_a_terminal`
    False: into a pipe or a file, lines are as long as their text (`mdcli explain | less -S`)."""
    console = _Console(
        file=file,
        color_system="auto" if color else None,
        no_color=not color,
        highlight=False,
    )
    if not wrap_off_a_terminal and not console.is_terminal:
        console.width = PIPED_WIDTH
    return console


@dataclass(frozen=True)
class Grid:
    """Where panels go: `columns` across, each `width` cells wide and at most `height` tall."""

    columns: int
    width: int
    height: int


def column_count(panels: int, width: int) -> int:
    """As many columns as fit at a readable width, at most three, never more than panels."""
    return max(1, min(MAX_COLUMNS, width // MIN_PANEL_WIDTH, panels))


def plan_grid(panels: int, width: int, room: int) -> Grid:
    """Share `room` lines of a `width`-cell terminal among `panels` panels (one cell between
    columns). Panels never get shorter than three lines; if even that does not fit, Live crops
    the frame's bottom rather than the frame growing past the terminal."""
    columns = column_count(panels, width)
    rows = math.ceil(panels / columns) if panels else 1
    panel_width = max(1, (width - (columns - 1)) // columns)
    return Grid(columns, panel_width, max(MIN_PANEL_HEIGHT, room // rows))


def recent_text(text: str, width: int, lines: int) -> str:
    """The part of `text` that can reach the last `lines` lines once wrapped at `width`, so that
    only that part has to be wrapped on each refresh. It starts at a line break where possible:
    wrapping from mid-paragraph would move the line breaks as the text grows."""
    budget = 2 * lines * (width + 1)
    if len(text) <= budget:
        return text
    cut = len(text) - budget
    paragraph_start = text.rfind("\n", 0, cut) + 1
    return (
        text[paragraph_start:]
        if len(text) - paragraph_start <= 8 * budget
        else text[cut:]
    )


def tail_lines(console: Console, text: str, width: int, lines: int) -> Lines:
    """The last `lines` lines of `text` wrapped at `width`. (A Panel with a fixed height crops
    the newest lines, so the tail has to be cut before the text goes into the panel.)"""
    visible = recent_text(text, width, lines).translate(_CONTROL_PICTURES)
    wrapped = Text(visible).wrap(console, max(1, width), overflow="fold")
    return Lines(wrapped[-lines:])


class LiveRenderer:
    """Panels for running branches on `console` (stdout), chrome on `chrome` (stderr).

    `quiet` drops the header and the summary line; notes and the interruption mark are kept
    because they change what the answers mean. While the run goes on, a progress line under
    the header (not in the final frame) says how far a prefill or the decode has got;
    `progress` is a second place to report it (a log on a non-terminal stderr, --progress).

    `answers(stdout, stderr)` makes the renderer whose stdout text is printed below the final
    frame (render/choose.py passes plain output's): so the answers on stdout are the same
    whatever the renderer, margins' blocks, a vote and beam scores included. Without it each
    settled branch is printed under its label.
    """

    def __init__(
        self,
        console: Console,
        chrome: Console,
        *,
        header: str | None = None,
        quiet: bool = False,
        progress: ProgressDisplay | None = None,
        answers: Callable[[TextIO, TextIO], Renderer] | None = None,
    ) -> None:
        self._console = console
        self._answer_text, self._answer_notes = io.StringIO(), io.StringIO()
        self._answers_renderer = None if answers is None else answers(self._answer_text, self._answer_notes)
        self._chrome = chrome
        self._header = header
        self._quiet = quiet
        self._book = BranchBook()
        self._notes: list[Note] = []
        self._progress = ProgressFeed(progress)  # its state also feeds the frame's progress line
        self._lock = threading.RLock()  # the refresh thread reads what handle() writes
        self._final = False
        self._live = Live(
            console=console,
            get_renderable=self._frame,
            transient=False,
            refresh_per_second=REFRESH_PER_SECOND,
        )
        self._started = False
        self._stopped = False

    def handle(self, event: Event) -> None:
        if self._answers_renderer is not None:
            self._answers_renderer.handle(event)  # writes only to its buffers, printed at the end
        with self._lock:
            self._book.apply(event)
            if not self._final:
                self._progress.handle(event)  # (a display here is only ThrottledLines: no thread)
            if isinstance(event, Start) and self._header is None:
                self._header = describe_start(event)
            if isinstance(event, Note):
                self._notes.append(event)
        # Live methods are called outside this renderer's lock: the refresh thread takes Live's lock
        # before this one, so taking them the other way round could deadlock.
        if isinstance(event, Start):
            self._start_live()
        elif isinstance(event, Done):
            self._end_run(event)
        elif isinstance(event, (Fork, Prune, Finish, Note)):
            self.refresh()

    def interrupted(self) -> None:
        """Stop the display, print the partial answers in full, and say they were cut short."""
        if self._final:
            return
        self._end_run(None)
        self._chrome.print(Text("interrupted", style="bold yellow"))

    def close(self) -> None:
        """Stop the display if it is still running (for example after an exception)."""
        self._progress.stop()
        if self._started and not self._stopped:
            self._live.stop()
            # rich ends the last frame with a newline on a terminal only: into a pipe or a file
            # (`-o live | cat`) the answers would start on the frame's last line
            on_a_screen = self._console.is_terminal and not self._console.is_dumb_terminal
            if not on_a_screen and self._frame_has_lines():
                self._console.line()
        self._stopped = True

    def _frame_has_lines(self) -> bool:
        with self._lock:
            return bool(self._header_lines() or (self._final and self._answers()))

    def refresh(self) -> None:
        """Redraw now, rather than at the next tick: used when branches appear, end or vanish,
        so the layout follows the run without waiting."""
        if self._started and not self._stopped:
            self._live.refresh()

    def _start_live(self) -> None:
        if not self._started:
            self._started = True
            self._live.start(refresh=True)

    def _end_run(self, done: Done | None) -> None:
        """Settle unfinished branches as interrupted, leave a compact final frame, and print
        the answers in full below it (once: a Done after Ctrl-C, or twice, changes nothing)."""
        if self._final:
            return
        with self._lock:
            for finish in interrupted_finishes(self._book):
                self._book.apply(finish)
            self._final = True
        self.close()
        self._print_answers(interrupted=done is None)
        self._print_notes()
        if done is not None and not self._quiet:
            line = summary_line(self._book, done.stats, interrupted=done.interrupted)
            self._chrome.print(Text(line, style="dim"))

    def _print_answers(self, interrupted: bool = False) -> None:
        if self._answers_renderer is not None:
            if interrupted:
                self._answers_renderer.interrupted()
            self._console.print(Text(self._answer_text.getvalue()), end="", soft_wrap=True)
            for line in self._answer_notes.getvalue().splitlines():
                self._chrome.print(Text(line, style="italic"))
            return
        answers = self._answers()
        for branch in answers:
            block = answer_block(branch.label, branch.text, headered=len(answers) >= 2, sources=branch.sources)
            self._console.print(Text(block), end="", soft_wrap=True)

    def _print_notes(self) -> None:
        """All notes, in full: the display only had room for the last few, cut to one line."""
        for note in self._notes:
            self._chrome.print(Text(_note_text(note), style="italic"))

    def _answers(self) -> list[BranchState]:
        return [
            branch for branch in self._book.in_tree_order() if branch.status != "pruned"
        ]

    def _frame(self) -> RenderableType:
        with self._lock:
            return self._final_frame() if self._final else self._running_frame()

    def _header_lines(self) -> list[Text]:
        if self._quiet or not self._header:
            return []
        return [Text(self._header, style="bold", no_wrap=True, overflow="ellipsis")]

    def _progress_lines(self) -> list[RenderableType]:
        """The running frame's progress line (prefill, then decode counts); none when quiet."""
        shown = None if self._quiet else self._progress.state.renderable()
        return [] if shown is None else [shown]

    def _final_frame(self) -> RenderableType:
        """What stays on screen above the full answers: one status line per branch."""
        return Group(
            *self._header_lines(), *(_status_line(branch) for branch in self._answers())
        )

    def _running_frame(self) -> RenderableType:
        width, height = self._console.size
        top = [*self._header_lines(), *self._progress_lines()]
        bottom = [_note_line(note) for note in self._notes[-NOTES_SHOWN:]]
        room = height - len(top) - len(bottom) - SPARE_LINES
        shown = self._answers()
        if _rows_needed(len(shown), width) * MIN_PANEL_HEIGHT > room:
            shown, finished = _split_finished(shown)
            if finished:
                bottom.insert(0, _finished_line(finished))
                room -= 1
        return Group(
            *top, self._panels(shown, plan_grid(len(shown), width, room)), *bottom
        )

    def _panels(self, branches: list[BranchState], grid: Grid) -> RenderableType:
        if not branches:
            return Text()
        inner_width = max(1, grid.width - PANEL_CHROME_WIDTH)
        body_lines = max(1, grid.height - PANEL_CHROME_HEIGHT)
        tails = [
            tail_lines(self._console, branch.text, inner_width, body_lines)
            for branch in branches
        ]
        height = max(
            MIN_PANEL_HEIGHT, max(len(tail) for tail in tails) + PANEL_CHROME_HEIGHT
        )
        table = Table.grid(padding=(0, 1))
        for _ in range(grid.columns):
            table.add_column()
        panels = [
            _branch_panel(branch, tail, grid.width, height)
            for branch, tail in zip(branches, tails)
        ]
        for row_start in range(0, len(panels), grid.columns):
            table.add_row(*panels[row_start : row_start + grid.columns])
        return table


def _rows_needed(panels: int, width: int) -> int:
    return math.ceil(panels / column_count(panels, width)) if panels else 0


def _split_finished(
    branches: list[BranchState],
) -> tuple[list[BranchState], list[BranchState]]:
    """Running branches keep their panels; finished ones give theirs up when space runs out."""
    running = [branch for branch in branches if branch.status == "running"]
    finished = [branch for branch in branches if branch.status == "finished"]
    return running, finished


def _branch_panel(branch: BranchState, tail: Lines, width: int, height: int) -> Panel:
    done = branch.status == "finished"
    title = Text("↳ " if branch.parent is not None else "") + Text(
        branch.label, style="" if done else "bold"
    )
    if done:
        title.append(" ✓", style="green")
    return Panel(
        Text("\n").join(tail),
        title=title,
        title_align="left",
        subtitle=Text(_branch_facts(branch)),
        subtitle_align="right",
        border_style="dim" if done else "cyan",
        width=width,
        height=height,
    )


def _branch_facts(branch: BranchState) -> str:
    """Token count, how it ended (once it has), cumulative logprob, and the strategy's score
    (beam search ranks by a length-normalised score, not by the raw logprob)."""
    facts = [f"{branch.token_count} tok"]
    if branch.finish_reason:
        facts.append(branch.finish_reason)
    facts.append(f"lp {branch.cumulative_logprob:.2f}")
    if branch.score is not None:
        facts.append(f"score {branch.score:.2f}")
    return " · ".join(facts)


def _status_line(branch: BranchState) -> Text:
    mark = (
        ("✓ ", "green")
        if branch.finish_reason in ("stop", "length")
        else ("… ", "yellow")
    )
    return Text.assemble(
        mark,
        branch.label,
        (f"  {_branch_facts(branch)}", "dim"),
        no_wrap=True,
        overflow="ellipsis",
    )


def _finished_line(branches: list[BranchState]) -> Text:
    labels = ", ".join(branch.label for branch in branches)
    return Text(f"✓ {labels}", style="dim", no_wrap=True, overflow="ellipsis")


def _note_line(note: Note) -> Text:
    return Text(_note_text(note), style="italic", no_wrap=True, overflow="ellipsis")


def _note_text(note: Note) -> str:
    return f"{note.kind}: {note.message}"
