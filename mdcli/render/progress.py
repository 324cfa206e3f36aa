"""Progress on stderr: what a long run is doing while no answer is ready yet.

Two facts are worth showing: how far a prefill has got (`Progress` events in tokens, one per
forward, so a 1,819-token document moves "prefill 1,024 / 1,819 tokens" at the 1,024-token
forward), and, once tokens flow, how many branches have finished ("decode: 3 of 8 branches
finished, 412 tokens", counted from the Token/Fork/Finish events every renderer receives and
named after the latest decode `Progress`, which the decoding loop sends after each step).

Where it goes depends on stderr, never on stdout:
* a terminal: one transient Rich status line (`TerminalStatus`), erased before anything else is
  written and when the run ends, so the scrollback holds only the answers and the summary;
* anything else (a log file, a pipe): nothing, unless `--progress` asked for it, then at most
  one plain line every few seconds (`ThrottledLines`);
* `--quiet`: nothing at all.
The live display shows the same status in its own frame instead (see live.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, TextIO

from rich.console import Console, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from mdcli.events import Done, Event, Finish, Fork, Progress, Prune, Start, Token

LINE_INTERVAL_SECONDS = 3.0  # --progress on a non-terminal: at most one line this often
STATUS_REFRESH_PER_SECOND = 8
BAR_WIDTH = 24


class RunProgress:
    """The run's progress folded from its events: the current prefill while it is under way,
    then decode counts. Cheap to update, since it sees every Token.

    `at_step_end`: the last event was a Progress, i.e. a forward has just ended; the counts are
    then those of a whole step, not of the middle of one step's tokens.
    """

    def __init__(self) -> None:
        self.prefill: Progress | None = None
        self.decode_phase = "decode"
        self.branches = 0
        self.settled = 0
        self.tokens = 0
        self.at_step_end = False

    def apply(self, event: Event) -> None:
        self.at_step_end = isinstance(event, Progress)
        if isinstance(event, Token):
            self.tokens += 1
        elif isinstance(event, Progress):
            self._progress(event)
        elif isinstance(event, Start):
            self.branches += len(event.branches)
        elif isinstance(event, Fork):
            self.branches += 1
        elif isinstance(event, (Finish, Prune)):
            self.settled += 1

    def _progress(self, event: Progress) -> None:
        if event.unit == "tokens":  # a prefill
            self.prefill = event if event.done < event.total else None
        else:  # a decode step
            self.prefill = None
            self.decode_phase = event.phase

    @property
    def active(self) -> bool:
        """Whether there is anything to say (cheaper than building the line, for every Token)."""
        return self.prefill is not None or self.tokens > 0

    def line(self) -> str | None:
        """E.g. ``prefill 1,024 / 1,819 tokens`` or ``decode: 3 of 8 branches finished, 412
        tokens``; None before there is anything to say."""
        p = self.prefill  # read once: a status thread may call this while apply() runs
        if p is not None:
            return f"{p.phase} {p.done:,} / {p.total:,} {p.unit}"
        if self.tokens == 0:
            return None
        tokens = f"{self.tokens:,} token" + ("" if self.tokens == 1 else "s")
        return f"{self.decode_phase}: {self.settled:,} of {self.branches:,} branches finished, {tokens}"

    def renderable(self) -> RenderableType | None:
        """The line for a terminal: a spinner, and a bar while a prefill runs."""
        p = self.prefill  # read once, as in line()
        line = self.line()
        if line is None:
            return None
        row = Table.grid(padding=(0, 1))
        cells: list[RenderableType] = [Spinner("dots", style="cyan")]
        if p is not None:
            cells.append(Text(p.phase))
            cells.append(ProgressBar(total=p.total, completed=p.done, width=BAR_WIDTH))
            cells.append(Text(f"{p.done:,} / {p.total:,} {p.unit}", style="dim"))
        else:
            cells.append(Text(line, style="dim"))
        for _ in cells:
            row.add_column(no_wrap=True)
        row.add_row(*cells)
        return row


class ProgressDisplay(Protocol):
    """Where a renderer sends progress: `show` after each event, `clear` before writing
    anything else to the same terminal, `stop` at the end (both safe to repeat)."""

    def show(self, progress: RunProgress) -> None: ...

    def clear(self) -> None: ...

    def stop(self) -> None: ...


class TerminalStatus:
    """A transient status line on a terminal's stderr, redrawn by Rich's refresh thread (so the
    spinner moves during a forward that takes seconds) and erased by `clear`/`stop`."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._progress: RunProgress | None = None
        self._lock = threading.RLock()  # the refresh thread reads what show() was given
        self._live: Live | None = None
        self._drawn_prefill: Progress | None = None
        self._stopped = False

    def show(self, progress: RunProgress) -> None:
        with self._lock:
            self._progress = progress
        if self._stopped or not progress.active:
            return
        if self._live is None:
            self._live = Live(
                console=self._console,
                get_renderable=self._frame,
                transient=True,
                refresh_per_second=STATUS_REFRESH_PER_SECOND,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start()
        if progress.prefill is not self._drawn_prefill:  # a forward ended: show it now, not at the next tick
            self._drawn_prefill = progress.prefill
            self._live.refresh()

    def clear(self) -> None:
        """Erase the line; the next `show` draws it again."""
        if self._live is not None:
            self._live.stop()
            self._live = None
            self._drawn_prefill = None

    def stop(self) -> None:
        self.clear()
        self._stopped = True

    def _frame(self) -> RenderableType:
        with self._lock:
            shown = None if self._progress is None else self._progress.renderable()
        return shown if shown is not None else Text()


class ThrottledLines:
    """``mdcli: prefill 1,024 / 1,819 tokens`` on a non-terminal stderr, at most one line per
    `interval` seconds (the first one `interval` seconds after the run starts, so a quick run
    writes none), only as a forward ends (so decode counts are whole steps), and never the same
    line twice in a row."""

    def __init__(
        self, stream: TextIO, *, interval: float = LINE_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._stream = stream
        self._interval = interval
        self._clock = clock
        self._last_time = clock()
        self._last_line: str | None = None
        self._stopped = False

    def show(self, progress: RunProgress) -> None:
        if self._stopped or not progress.at_step_end:
            return
        now = self._clock()
        if now - self._last_time < self._interval:
            return
        line = progress.line()
        if line is None or line == self._last_line:
            return
        self._stream.write(f"mdcli: {line}\n")
        self._stream.flush()
        self._last_time, self._last_line = now, line

    def clear(self) -> None:
        """Lines need no erasing."""

    def stop(self) -> None:
        self._stopped = True


class ProgressFeed:
    """A renderer's side of progress: fold each event in and hand the state to its display
    (None: nothing shown), which stops at Done."""

    def __init__(self, display: ProgressDisplay | None) -> None:
        self.display = display
        self.state = RunProgress()

    def handle(self, event: Event) -> None:
        self.state.apply(event)
        if self.display is None:
            return
        if isinstance(event, Done):
            self.display.stop()
        else:
            self.display.show(self.state)

    def clear(self) -> None:
        if self.display is not None:
            self.display.clear()

    def stop(self) -> None:
        if self.display is not None:
            self.display.stop()


def choose_progress(
    mode: str, stdout: TextIO, stderr: TextIO, *, quiet: bool, requested: bool, terminal: Callable[[], Console]
) -> ProgressDisplay | None:
    """The stderr display the rules above pick for a `mode` renderer (None: show nothing).
    `terminal` makes the stderr console, asked for only when a status line is drawn."""
    if quiet:
        return None
    if not isatty(stderr):
        return ThrottledLines(stderr) if requested else None
    if mode in ("plain", "json") or (mode == "jsonl" and not isatty(stdout)):
        return TerminalStatus(terminal())
    # live: its frame shows the progress; JSONL lines on the same terminal would break a status line
    return None


def isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream: not a terminal
        return False
