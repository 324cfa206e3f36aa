"""Progress for long work: the prefill reports after each forward, and every renderer shows it on
stderr by the rules of render/progress.py (a terminal: a transient status line; anything else:
nothing unless --progress, then throttled lines; --quiet: nothing), never on stdout."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mdcli.api import run_specs
from mdcli.cli.app import app
from mdcli.core.decoding import BranchSpec, common_prefix_length
from mdcli.events import BranchInfo, Done, Finish, Progress, Start, Stats, Token
from mdcli.models.load import load_model
from mdcli.render import JsonlRenderer, LiveRenderer, PlainRenderer, choose_renderer
from mdcli.render.progress import RunProgress, TerminalStatus, ThrottledLines
from tests.reference import generate_alone

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ERASE_LINE = "\x1b[2K"


class TerminalStringIO(io.StringIO):
    """A StringIO that says it is a terminal, as a real tty would."""

    def isatty(self) -> bool:
        return True


class Clock:
    """A clock the test moves by hand, so throttling is checked without sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def start(*labels: str) -> Start:
    branches = [BranchInfo(id=i, label=label, prompt_token_ids=[1, 2, 3]) for i, label in enumerate(labels)]
    return Start("tiny", "cpu", "float32", "exact on CPU", "sdpa", "ask-many", 0, branches)


def done() -> Done:
    return Done(Stats(1819, 1819, 2, 1, 9.0, 8.0, 1.0, 1821, 1821, 0))


def a_long_run() -> list:
    """A 1,819-token prefill in two forwards, then two two-token answers: what a Decoder sends."""
    return [
        start("Who?", "Where?"),
        Progress("prefill", 0, 1819),
        Progress("prefill", 1024, 1819),
        Progress("prefill", 1819, 1819),
        Token(0, 11, "Mara", -0.1),
        Token(1, 12, "Brit", -0.2),
        Progress("decode", 0, 2, "branches"),
        Token(0, 13, ".", -0.1),
        Finish(0, "Who?", "Mara.", [11, 13], "stop", -0.2),
        Token(1, 14, "tany", -0.2),
        Finish(1, "Where?", "Brittany", [12, 14], "stop", -0.4),
        Progress("decode", 2, 2, "branches"),
        done(),
    ]


def terminal_console(file: io.StringIO) -> Console:
    return Console(file=file, force_terminal=True, width=100, height=24, color_system=None)


def screen_text(output: str) -> str:
    return ANSI_ESCAPE.sub("", output)


# -- what the status says ------------------------------------------------------------------------


def test_the_status_says_how_far_the_prefill_is_then_how_many_branches_finished():
    progress = RunProgress()
    seen = []
    for event in a_long_run()[:-1]:
        progress.apply(event)
        seen.append(progress.line())
    assert seen == [
        None,  # Start: nothing to say yet
        "prefill 0 / 1,819 tokens",
        "prefill 1,024 / 1,819 tokens",
        None,  # prefill complete, no token yet
        "decode: 0 of 2 branches finished, 1 token",
        "decode: 0 of 2 branches finished, 2 tokens",
        "decode: 0 of 2 branches finished, 2 tokens",  # the step ends
        "decode: 0 of 2 branches finished, 3 tokens",
        "decode: 1 of 2 branches finished, 3 tokens",
        "decode: 1 of 2 branches finished, 4 tokens",
        "decode: 2 of 2 branches finished, 4 tokens",
        "decode: 2 of 2 branches finished, 4 tokens",
    ]


def test_the_status_names_the_strategy_phase_of_the_decode():
    progress = RunProgress()
    for event in [start("margin 1"), Token(0, 5, "x", -1.0), Progress("classification decode", 0, 1, "branches")]:
        progress.apply(event)
    assert progress.line() == "classification decode: 0 of 1 branches finished, 1 token"


# -- plain: a terminal stderr shows a transient status ------------------------------------------


def shows_progress(text: str) -> bool:
    """Whether a progress line is in `text`: a prefill's count ("1,024 / 1,819 tokens") or a
    decode's ("decode: 1 of 2 branches finished"). The summary line's "(prefill 8.0 s, ...)" is not one."""
    return bool(re.search(r"[\d,]+ / [\d,]+ tokens|decode:", text))


def test_plain_on_a_terminal_stderr_shows_the_prefill_on_stderr_then_erases_it():
    stdout, stderr = io.StringIO(), io.StringIO()
    status = TerminalStatus(terminal_console(stderr))
    renderer = PlainRenderer(stdout, stderr, header="tiny", progress=status)
    events = a_long_run()
    for event in events[:3]:
        renderer.handle(event)
    assert "prefill" in screen_text(stderr.getvalue())
    assert "1,024 / 1,819 tokens" in screen_text(stderr.getvalue())
    for event in events[3:]:
        renderer.handle(event)
    renderer.close()
    assert stdout.getvalue() == "## Who?\nMara.\n\n## Where?\nBrittany\n\n"
    after_last_erase = screen_text(stderr.getvalue().rsplit(ERASE_LINE, 1)[-1])
    assert not shows_progress(after_last_erase)
    assert "2 branches" in after_last_erase  # the summary line stays, the status went


def test_choose_renderer_draws_the_status_only_where_it_cannot_break_stdout():
    def status_of(mode, stdout):
        renderer = choose_renderer(
            mode, stdout=stdout, stderr=TerminalStringIO(), quiet=False, no_color=True, progress=False
        )
        renderer.close()
        return renderer._progress.display

    assert isinstance(status_of("plain", io.StringIO()), TerminalStatus)
    assert isinstance(status_of("jsonl", io.StringIO()), TerminalStatus)
    assert status_of("jsonl", TerminalStringIO()) is None  # JSONL lines on the same terminal
    assert status_of("live", TerminalStringIO()) is None  # the live frame shows it instead


# -- a non-terminal stderr: nothing unless --progress, then throttled lines ----------------------


@pytest.mark.parametrize("mode", ["plain", "jsonl", "live"])
def test_a_non_terminal_stderr_gets_no_progress_without_the_flag(mode):
    stdout, stderr = io.StringIO(), io.StringIO()
    renderer = choose_renderer(mode, stdout=stdout, stderr=stderr, quiet=False, no_color=True, progress=False)
    for event in a_long_run():
        renderer.handle(event)
    renderer.close()
    assert not shows_progress(stderr.getvalue())
    assert "1,024 / 1,819" not in stdout.getvalue() and '"progress"' not in stdout.getvalue()


def test_progress_lines_come_as_forwards_end_at_most_once_per_interval_and_never_repeat():
    clock = Clock()
    stdout, stderr = io.StringIO(), io.StringIO()
    lines = ThrottledLines(stderr, interval=3.0, clock=clock)
    renderer = PlainRenderer(stdout, stderr, quiet=False, header="tiny", progress=lines)
    *run, end = a_long_run()
    events = [*run, Progress("decode", 2, 2, "branches"), end]
    # start, 3 prefill forwards, step 1 (2 tokens, its end), step 2 (4 events, its end), again, done
    times = [100.0, 101.0, 104.5, 106.0, 108.0, 108.0, 108.0, 109.0, 109.0, 111.6, 111.6, 111.6, 116.0, 117.0]
    for now, event in zip(times, events, strict=True):
        clock.now = now
        renderer.handle(event)
    progress_lines = [line for line in stderr.getvalue().splitlines() if line.startswith("mdcli: ")]
    assert progress_lines == [
        "mdcli: prefill 1,024 / 1,819 tokens",  # 4.5 s in; 0 / 1,819 at 1 s was too soon
        # the tokens at 108.0 are mid-step: the line waits for the step's end, 3.5 s after the last
        "mdcli: decode: 0 of 2 branches finished, 2 tokens",
        "mdcli: decode: 2 of 2 branches finished, 4 tokens",  # 3.6 s later; the same line at 116 is not repeated
    ]
    assert "mdcli:" not in stdout.getvalue()


def test_progress_lines_with_the_flag_go_to_stderr_and_jsonl_stdout_stays_pure_events():
    stdout, stderr = io.StringIO(), io.StringIO()
    renderer = JsonlRenderer(stdout, progress=ThrottledLines(stderr, interval=0.0))
    for event in a_long_run():
        renderer.handle(event)
    records = [json.loads(line) for line in stdout.getvalue().splitlines()]
    assert [r["type"] for r in records] == [
        "start", "token", "token", "token", "finish", "token", "finish", "answers", "done"]
    assert "mdcli: prefill 1,024 / 1,819 tokens" in stderr.getvalue().splitlines()


@pytest.mark.parametrize("mode", ["plain", "jsonl", "live"])
def test_quiet_silences_progress_even_on_a_terminal_and_with_the_flag(mode):
    stdout, stderr = io.StringIO(), TerminalStringIO()
    renderer = choose_renderer(mode, stdout=stdout, stderr=stderr, quiet=True, no_color=True, progress=True)
    for event in a_long_run():
        renderer.handle(event)
    renderer.close()
    assert "1,024 / 1,819" not in stderr.getvalue() + stdout.getvalue()
    assert "decode:" not in stderr.getvalue() + stdout.getvalue()


# -- live: the frame shows the prefill while the panels sit at 0 tok -----------------------------


def test_live_frame_shows_the_prefill_under_the_header_while_the_panels_are_empty():
    stdout, stderr = io.StringIO(), io.StringIO()
    renderer = LiveRenderer(terminal_console(stdout), terminal_console(stderr), header="tiny · cpu")
    events = a_long_run()
    try:
        for event in events[:3]:
            renderer.handle(event)
        renderer.refresh()
        frame = screen_text(stdout.getvalue().rsplit(ERASE_LINE, 1)[-1])
        assert "prefill" in frame and "1,024 / 1,819 tokens" in frame and "0 tok" in frame
        for event in events[3:]:
            renderer.handle(event)
    finally:
        renderer.close()
    final_frame = screen_text(stdout.getvalue().rsplit(ERASE_LINE, 1)[-1])
    assert not shows_progress(final_frame)
    assert not shows_progress(stderr.getvalue())


# -- the decoder reports each forward of a long prefill, and no token changes --------------------


def test_a_prefill_in_many_forwards_reports_each_one_and_gives_the_same_tokens(tiny_dir):
    lm = load_model(str(tiny_dir("llama")), quiet=True)
    document = "Mara lived in a small lighthouse on the coast of Brittany. " * 6
    prompts = [lm.tokenizer(f"{document}\nQ: {q}\nA:")["input_ids"] for q in ("Who?", "Where is it?")]

    def run(max_forward_tokens: int) -> list:
        specs = [BranchSpec(label=str(i), prompt_ids=list(p), max_new_tokens=6) for i, p in enumerate(prompts)]
        return list(run_specs(lm, specs, strategy="test", max_forward_tokens=max_forward_tokens))

    pieces, whole = run(16), run(4096)
    progress = [e for e in pieces if isinstance(e, Progress) and e.unit == "tokens"]
    fed = pieces[-1].stats.prefill_tokens
    assert fed > 3 * 16
    assert progress[0].done == 0 and progress[-1].done == fed
    assert all(p.total == fed and p.phase == "prefill" and p.unit == "tokens" for p in progress)
    assert all(0 < b.done - a.done <= 16 for a, b in zip(progress, progress[1:]))
    assert len(progress) >= fed // 16 + 1
    shared = common_prefix_length(*prompts)  # one forward for the shared document, one for both tails
    assert [e.done for e in whole if isinstance(e, Progress) and e.unit == "tokens"] == [0, shared, fed]
    steps = [e for e in pieces if isinstance(e, Progress) and e.unit == "branches"]
    assert len(steps) == pieces[-1].stats.steps + 1  # one per step; the last step feeds nothing
    assert all(e.phase == "decode" and e.total == 2 for e in steps) and steps[-1].done == 2

    def finishes(events):
        return [e.token_ids for e in events if isinstance(e, Finish)]

    assert finishes(pieces) == finishes(whole)
    for prompt, tokens in zip(prompts, finishes(pieces)):
        assert tokens == generate_alone(lm.model, prompt, len(tokens))


# -- the command line ----------------------------------------------------------------------------

runner = CliRunner()


@pytest.fixture()
def story(tmp_path):
    path = tmp_path / "story.txt"
    path.write_text("Mara lived in a small lighthouse on the coast of Brittany. " * 8)
    return path


def test_cli_progress_and_quiet_together_are_refused_before_loading(story):
    result = runner.invoke(app, ["ask-many", str(story), "-q", "Who?", "--progress", "--quiet"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "mdcli: error: --progress and --quiet contradict each other; give one of them"


@pytest.mark.parametrize("command", ["ask-many", "run", "beam", "margins", "think"])
def test_every_generating_command_takes_progress(command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert "--progress" in result.stdout


def test_cli_progress_leaves_stdout_and_jsonl_stdout_unchanged(story):
    # a fixed number of guesses: auto picks forward widths by timing, so its logprobs' last bits can vary
    base = ["ask-many", str(story), "-q", "Who?", "-q", "Where?", "-n", "4", "--max-forward-tokens", "16",
            "--speculate", "2"]
    for output in (["--output", "plain"], ["--jsonl"]):
        plain = runner.invoke(app, base + output)
        with_progress = runner.invoke(app, base + output + ["--progress"])
        assert plain.exit_code == 0 and with_progress.exit_code == 0, with_progress.stderr
        if output == ["--jsonl"]:
            strip = [json.loads(line) for line in with_progress.stdout.splitlines()]
            assert "progress" not in {record["type"] for record in strip}
            plain_records = [json.loads(line) for line in plain.stdout.splitlines()]
            assert [r for r in strip if r["type"] != "done"] == [r for r in plain_records if r["type"] != "done"]
        else:
            assert with_progress.stdout == plain.stdout


def test_without_a_terminal_or_progress_no_loading_line_goes_to_stderr(story):
    # issue 53: the loader said "loading ..." into a log file, where docs/cli.md promises no progress
    base = ["ask-many", str(story), "-q", "Who?", "-n", "1"]
    plain = runner.invoke(app, base + ["--plain"])
    assert plain.exit_code == 0, plain.stderr
    assert not any(line.startswith("mdcli: loading") for line in plain.stderr.splitlines())
    asked = runner.invoke(app, base + ["--plain", "--progress"])
    assert sum(line.startswith("mdcli: loading ") for line in asked.stderr.splitlines()) == 1


@pytest.mark.parametrize("mode", ["--json", "--jsonl"])
def test_json_and_jsonl_leave_the_header_and_summary_to_the_stream(story, mode):
    result = runner.invoke(app, ["ask-many", str(story), "-q", "Who?", "-n", "1", mode])
    assert result.exit_code == 0 and result.stderr == ""
