"""Renderers: what each output mode promises, checked on real events and real Rich consoles."""

from __future__ import annotations

import io
from dataclasses import replace
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from mdcli.events import (
    BranchInfo,
    Done,
    Finish,
    Fork,
    Note,
    Prune,
    Start,
    Stats,
    Token,
)
from mdcli.render import (
    BranchBook,
    JsonlRenderer,
    LiveRenderer,
    PlainRenderer,
    choose_renderer,
)
from mdcli.render.base import answer_block, describe_start, interrupted_finishes, summary_line
from mdcli.render.live import MIN_PANEL_HEIGHT, plan_grid, tail_lines

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SGR_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


# --- real events, built by hand ------------------------------------------------------------


def start(*labels: str) -> Start:
    return Start(
        model="tiny-llama",
        device="cpu",
        dtype="float32",
        dtype_reason="exact on CPU",
        attn="sdpa",
        strategy="ask-many",
        seed=0,
        branches=[
            BranchInfo(id=i, label=label, prompt_token_ids=[1, 2, 3])
            for i, label in enumerate(labels)
        ],
    )


def token(branch: int, text: str, token_id: int = 7, logprob: float = -0.5) -> Token:
    return Token(branch=branch, token_id=token_id, text=text, logprob=logprob)


def finish(
    branch: int, label: str, text: str, tokens: int = 1, reason: str = "stop"
) -> Finish:
    return Finish(
        branch=branch,
        label=label,
        text=text,
        token_ids=[7] * tokens,
        finish_reason=reason,
        cumulative_logprob=-0.5 * tokens,
    )


def fork(branch: int, label: str, parent: int) -> Fork:
    return Fork(
        BranchInfo(id=branch, label=label, prompt_token_ids=[1, 2, 3], parent=parent)
    )


def done(generated: int = 4, *, interrupted: bool = False) -> Done:
    stats = Stats(
        prompt_tokens=3,
        prefill_tokens=3,
        generated_tokens=generated,
        steps=2,
        seconds=1.0,
        prefill_seconds=0.2,
        decode_seconds=0.8,
        peak_cache_tokens=11,
        final_cache_tokens=9,
        compactions=0,
    )
    return Done(stats=stats, interrupted=interrupted)


class TerminalStringIO(io.StringIO):
    """A StringIO that says it is a terminal, as a real tty would."""

    def isatty(self) -> bool:
        return True


def screen_text(output: str) -> str:
    return ANSI_ESCAPE.sub("", output)


def last_frame(output: str) -> str:
    """The most recent Live frame: Live erases the previous frame line by line (ESC[2K)
    before drawing the next one."""
    return screen_text(output.rsplit("\x1b[2K", 1)[-1])


# --- BranchBook ------------------------------------------------------------------------------


def test_branch_book_accumulates_text_token_count_and_logprob_per_branch():
    book = BranchBook()
    for event in [
        start("a", "b"),
        token(0, "Hel", logprob=-1.0),
        token(1, "x"),
        token(0, "lo", logprob=-0.25),
    ]:
        book.apply(event)
    assert book[0].text == "Hello"
    assert book[0].token_count == 2
    assert book[0].cumulative_logprob == pytest.approx(-1.25)
    assert book[1].text == "x"
    assert [branch.status for branch in book] == ["running", "running"]


def test_branch_book_takes_finish_text_as_authoritative_because_stop_strings_are_removed():
    book = BranchBook()
    for event in [
        start("a"),
        token(0, "yes"),
        token(0, "STOP"),
        finish(0, "a", "yes", tokens=3),
    ]:
        book.apply(event)
    assert book[0].text == "yes"
    assert book[0].token_count == 3
    assert book[0].status == "finished"
    assert book[0].finish_reason == "stop"


def test_branch_book_orders_branches_by_announcement_start_then_forks():
    book = BranchBook()
    for event in [
        start("a", "b"),
        fork(2, "a/more", parent=0),
        Prune(branch=1, label="b", reason="beam"),
    ]:
        book.apply(event)
    assert [branch.label for branch in book] == ["a", "b", "a/more"]
    assert book[1].status == "pruned"
    assert book[2].parent == 0


def test_branch_book_tree_order_puts_each_fork_right_after_its_parent():
    book = BranchBook()
    for event in [
        start("a", "b"),
        fork(2, "b/1", parent=1),
        fork(3, "a/1", parent=0),
        fork(4, "a/1/x", parent=3),
    ]:
        book.apply(event)
    assert [branch.label for branch in book.in_tree_order()] == [
        "a",
        "a/1",
        "a/1/x",
        "b",
        "b/1",
    ]


def test_branch_book_rejects_events_for_branches_never_announced():
    book = BranchBook()
    book.apply(start("a"))
    with pytest.raises(ValueError, match="never announced"):
        book.apply(token(5, "x"))


def test_interrupted_finishes_carry_partial_state_of_running_branches_only():
    book = BranchBook()
    for event in [
        start("a", "b", "c"),
        token(0, "par", token_id=11),
        token(0, "tial", token_id=12),
    ]:
        book.apply(event)
    book.apply(finish(1, "b", "done"))
    book.apply(Prune(branch=2, label="b", reason="beam"))
    (cut,) = interrupted_finishes(book)
    assert (cut.branch, cut.label, cut.text, cut.token_ids) == (
        0,
        "a",
        "partial",
        [11, 12],
    )
    assert cut.finish_reason == "interrupted"
    assert cut.cumulative_logprob == pytest.approx(-1.0)


def test_summary_line_reads_like_the_documented_example():
    book = BranchBook()
    book.apply(start(*[f"q{i}" for i in range(8)]))
    stats = Stats(
        prompt_tokens=900,
        prefill_tokens=900,
        generated_tokens=412,
        steps=37,
        seconds=5.2,
        prefill_seconds=0.0,
        decode_seconds=412 / 79.1,
        peak_cache_tokens=1912,
        final_cache_tokens=1800,
        compactions=0,
        peak_rss_bytes=612 * 2**20,
    )
    assert (
        summary_line(book, stats)
        == "8 branches · 412 tokens in 37 steps · 5.2 s (prefill 0.0 s, decode 5.2 s at 79.1 tok/s) · cache peak 1,912 tokens"
        " · peak RSS 612 MiB"
    )


def test_summary_line_leaves_out_a_resident_peak_the_platform_did_not_give():
    stats = Stats(prompt_tokens=9, prefill_tokens=9, generated_tokens=4, steps=2, seconds=1.0, prefill_seconds=0.2,
                  decode_seconds=0.8, peak_cache_tokens=13, final_cache_tokens=13, compactions=0, peak_rss_bytes=0)
    assert "RSS" not in summary_line(BranchBook(), stats)


def test_the_header_names_the_cpu_kernels_and_why_on_cpu_only():
    on_cpu = replace(start("q"), kernels="oneDNN (AVX-512: measured faster there)")
    assert describe_start(on_cpu).endswith("· kernels oneDNN (AVX-512: measured faster there)")
    assert "kernels" not in describe_start(replace(on_cpu, device="cuda:0", dtype="bfloat16"))


def test_answer_block_has_a_heading_only_when_there_are_several_answers():
    assert answer_block("q1", "text", headered=True) == "## q1\ntext\n\n"
    assert answer_block("q1", "text", headered=False) == "text\n"
    assert answer_block("q1", "text\n", headered=False) == "text\n"


# --- JSONL ------------------------------------------------------------------------------------


def run_jsonl(events) -> tuple[JsonlRenderer, io.StringIO]:
    stdout = io.StringIO()
    renderer = JsonlRenderer(stdout)
    for event in events:
        renderer.handle(event)
    return renderer, stdout


def test_jsonl_writes_one_parseable_line_per_event_in_order_from_start_to_done():
    events = [
        start("a", "b"),
        token(0, "hi"),
        Note("vote", "a wins"),
        finish(0, "a", "hi"),
        finish(1, "b", ""),
        done(),
    ]
    _, stdout = run_jsonl(events)
    records = [json.loads(line) for line in stdout.getvalue().splitlines()]
    # every event in order, with the `answers` line just before `done`
    assert [record["type"] for record in records] == [event.type for event in events[:-1]] + ["answers", "done"]
    assert records[0]["type"] == "start" and records[-1]["type"] == "done"
    assert records[1] == {
        "type": "token",
        "branch": 0,
        "token_id": 7,
        "text": "hi",
        "logprob": -0.5,
    }


def test_jsonl_keeps_non_ascii_text_readable():
    _, stdout = run_jsonl([start("a"), token(0, "héllo 世界")])
    assert "héllo 世界" in stdout.getvalue()


def test_jsonl_interrupted_finishes_each_unfinished_branch_then_writes_a_done_line():
    renderer, stdout = run_jsonl(
        [
            start("a", "b", "c"),
            token(0, "par", token_id=11),
            finish(1, "b", "ok"),
            Prune(2, "b", "beam"),
        ]
    )
    renderer.interrupted()
    records = [json.loads(line) for line in stdout.getvalue().splitlines()]
    cut, answers, final = records[-3], records[-2], records[-1]
    assert answers["type"] == "answers" and [a["label"] for a in answers["answers"]] == ["a", "b"]
    assert cut == {
        "type": "finish",
        "branch": 0,
        "label": "a",
        "text": "par",
        "token_ids": [11],
        "finish_reason": "interrupted",
        "cumulative_logprob": -0.5,
        "score": None,
        "parsed": None,
    }
    assert final == {"type": "done", "interrupted": True, "stats": None}
    assert [record["type"] for record in records].count("finish") == 2


def test_jsonl_interrupted_after_done_adds_nothing():
    renderer, stdout = run_jsonl([start("a"), finish(0, "a", "ok"), done()])
    before = stdout.getvalue()
    renderer.interrupted()
    assert stdout.getvalue() == before


# --- plain ------------------------------------------------------------------------------------


def plain(*, quiet: bool = False) -> tuple[PlainRenderer, io.StringIO, io.StringIO]:
    stdout, stderr = io.StringIO(), io.StringIO()
    return (
        PlainRenderer(
            stdout, stderr, quiet=quiet, header="tiny · cpu · float32 (exact)"
        ),
        stdout,
        stderr,
    )


def test_plain_prints_answers_in_branch_order_as_soon_as_all_earlier_ones_are_done():
    renderer, stdout, _ = plain()
    for event in [
        start("a", "b", "c"),
        finish(2, "c", "third"),
        finish(1, "b", "second"),
    ]:
        renderer.handle(event)
    assert stdout.getvalue() == ""
    renderer.handle(finish(0, "a", "first"))
    assert stdout.getvalue() == "## a\nfirst\n\n## b\nsecond\n\n## c\nthird\n\n"
    renderer.handle(done())
    assert stdout.getvalue() == "## a\nfirst\n\n## b\nsecond\n\n## c\nthird\n\n"


def test_plain_single_branch_prints_just_its_text():
    renderer, stdout, _ = plain()
    for event in [
        start("q"),
        token(0, "one two"),
        token(0, " three"),
        finish(0, "q", "one two three", 2),
        done(),
    ]:
        renderer.handle(event)
    assert stdout.getvalue() == "one two three\n"


def test_plain_gives_headings_when_a_single_branch_is_followed_by_a_fork():
    renderer, stdout, _ = plain()
    for event in [
        start("q"),
        finish(0, "q", "answer"),
        fork(1, "q/why", parent=0),
        finish(1, "q/why", "because"),
        done(),
    ]:
        renderer.handle(event)
    assert stdout.getvalue() == "## q\nanswer\n\n## q/why\nbecause\n\n"


def test_plain_does_not_print_pruned_branches():
    renderer, stdout, _ = plain()
    events = [
        start("beam0"),
        fork(1, "beam1", 0),
        fork(2, "beam2", 0),
        Prune(1, "b", "beam"),
        finish(0, "beam0", "A"),
        finish(2, "beam2", "C"),
        done(),
    ]
    for event in events:
        renderer.handle(event)
    assert stdout.getvalue() == "## beam0\nA\n\n## beam2\nC\n\n"


def test_plain_interrupted_prints_every_remaining_partial_answer_and_marks_it_on_stderr():
    renderer, stdout, stderr = plain()
    for event in [
        start("a", "b", "c"),
        token(0, "half"),
        finish(2, "c", "whole"),
        token(1, "bit"),
    ]:
        renderer.handle(event)
    renderer.interrupted()
    assert stdout.getvalue() == "## a\nhalf\n\n## b\nbit\n\n## c\nwhole\n\n"
    assert (
        "interrupted: a" in stderr.getvalue() and "interrupted: b" in stderr.getvalue()
    )
    assert "interrupted: c" not in stderr.getvalue()


def test_plain_interrupted_single_branch_prints_its_partial_text_alone():
    renderer, stdout, _ = plain()
    for event in [start("q"), token(0, "so far")]:
        renderer.handle(event)
    renderer.interrupted()
    assert stdout.getvalue() == "so far\n"


def test_plain_sends_header_notes_and_summary_to_stderr_only():
    renderer, stdout, stderr = plain()
    for event in [
        start("a"),
        Note("fallback", "used eager attention"),
        finish(0, "a", "x", 4),
        done(generated=4),
    ]:
        renderer.handle(event)
    assert stdout.getvalue() == "x\n"
    lines = stderr.getvalue().splitlines()
    assert lines[0] == "tiny · cpu · float32 (exact)"
    assert "fallback: used eager attention" in lines
    assert (
        lines[-1]
        == "1 branch · 4 tokens in 2 steps · 1.0 s (prefill 0.2 s, decode 0.8 s at 5.0 tok/s) · cache peak 11 tokens"
    )


def test_plain_quiet_drops_header_and_summary_but_keeps_notes():
    renderer, _, stderr = plain(quiet=True)
    for event in [
        start("a"),
        Note("fallback", "used eager attention"),
        finish(0, "a", "x"),
        done(),
    ]:
        renderer.handle(event)
    assert stderr.getvalue() == "fallback: used eager attention\n"


def test_plain_prints_nothing_twice_when_ctrl_c_follows_done():
    renderer, stdout, _ = plain()
    for event in [start("a", "b"), finish(0, "a", "x"), finish(1, "b", "y"), done()]:
        renderer.handle(event)
    before = stdout.getvalue()
    renderer.interrupted()
    assert stdout.getvalue() == before


@st.composite
def interleaved_runs(draw):
    """Branch texts as token lists, and an arbitrary interleaving of their events (each
    branch's tokens in order, then its Finish)."""
    texts = st.lists(st.text(alphabet="ab ç[]/", min_size=0, max_size=3), max_size=5)
    branches = draw(st.lists(texts, min_size=1, max_size=4))
    turns = draw(
        st.permutations(
            [b for b, tokens in enumerate(branches) for _ in range(len(tokens) + 1)]
        )
    )
    return branches, turns


@settings(max_examples=200, deadline=None)
@given(interleaved_runs())
def test_plain_prints_each_branch_full_text_exactly_once_in_branch_order_for_any_interleaving(
    run,
):
    branches, turns = run
    labels = [f"b{i}" for i in range(len(branches))]
    renderer, stdout, _ = plain()
    renderer.handle(start(*labels))
    sent = [0] * len(branches)
    for b in turns:
        if sent[b] < len(branches[b]):
            renderer.handle(token(b, branches[b][sent[b]]))
        else:
            renderer.handle(
                finish(b, labels[b], "".join(branches[b]), len(branches[b]))
            )
        sent[b] += 1
    renderer.handle(done())
    texts = ["".join(tokens) for tokens in branches]
    if len(branches) == 1:
        expected = texts[0] + "\n"
    else:
        expected = "".join(
            f"## {label}\n{text}\n\n" for label, text in zip(labels, texts)
        )
    assert stdout.getvalue() == expected


# --- live -------------------------------------------------------------------------------------


@pytest.fixture
def live():
    """Makes LiveRenderers on real terminal-like consoles and stops them after the test, so a
    failing test cannot leave a refresh thread or redirected stdout behind."""
    made: list[LiveRenderer] = []

    def make(
        width: int = 80,
        height: int = 24,
        *,
        header: str | None = "tiny · cpu · float32 (exact)",
    ):
        stdout, stderr = io.StringIO(), io.StringIO()
        console = Console(
            file=stdout,
            force_terminal=True,
            width=width,
            height=height,
            color_system=None,
        )
        chrome = Console(
            file=stderr,
            force_terminal=True,
            width=width,
            height=height,
            color_system=None,
        )
        renderer = LiveRenderer(console, chrome, header=header)
        made.append(renderer)
        return renderer, stdout, stderr

    yield make
    for renderer in made:
        renderer.close()


def numbered_lines(count: int) -> str:
    return "\n".join(f"line {i:02d}" for i in range(count))


def test_live_frame_shows_the_newest_lines_of_a_long_answer_not_its_beginning(live):
    renderer, stdout, _ = live()
    renderer.handle(start("essay"))
    renderer.handle(token(0, numbered_lines(60)))
    renderer.refresh()
    frame = last_frame(stdout.getvalue())
    assert "line 59" in frame
    assert "line 00" not in screen_text(stdout.getvalue())


def test_live_frame_shows_header_labels_token_counts_and_notes(live):
    renderer, stdout, _ = live()
    for event in [
        start("a", "b"),
        token(0, "x"),
        token(0, "y"),
        Note("vote", "a wins"),
    ]:
        renderer.handle(event)
    frame = last_frame(stdout.getvalue())
    assert frame.splitlines()[0] == "tiny · cpu · float32 (exact)"
    assert "a" in frame and "2 tok" in frame and "vote: a wins" in frame


def test_live_marks_finished_branches_and_shows_forks_right_after_their_parent(live):
    renderer, stdout, _ = live(width=40)
    for event in [start("a", "b"), finish(0, "a", "yes"), fork(2, "a/why", parent=0)]:
        renderer.handle(event)
    frame = last_frame(stdout.getvalue())
    assert "a ✓" in frame and "stop" in frame
    assert frame.index("a/why") < frame.index("─ b ")


def test_live_removes_pruned_branches_from_the_frame(live):
    renderer, stdout, _ = live()
    for event in [start("beam0"), fork(1, "beam1", 0), token(1, "x"), Prune(1, "b", "beam")]:
        renderer.handle(event)
    assert "beam1" not in last_frame(stdout.getvalue())


def test_live_shows_rich_markup_in_labels_and_text_literally(live):
    renderer, stdout, _ = live()
    renderer.handle(start("[bold]q[/bold]", "[/]"))
    renderer.handle(token(0, "[red]alert[/red] and [link=x]"))
    renderer.refresh()
    frame = last_frame(stdout.getvalue())
    assert "[bold]q[/bold]" in frame and "[/]" in frame
    assert "[red]alert[/red] and [link=x]" in frame


def test_live_frame_fits_the_terminal_height_with_many_branches(live):
    renderer, stdout, _ = live(width=80, height=24)
    labels = [f"q{i}" for i in range(12)]
    renderer.handle(start(*labels))
    for b in range(12):
        renderer.handle(token(b, numbered_lines(30)))
    renderer.refresh()
    frame = last_frame(stdout.getvalue())
    assert len(frame.splitlines()) <= 24
    assert all(f"─ {label} " in frame for label in labels)


def test_live_survives_a_tiny_terminal_and_still_prints_the_full_answers(live):
    renderer, stdout, _ = live(width=20, height=5)
    events = [
        start("first branch with a long label", "b"),
        token(0, numbered_lines(30)),
        token(1, "世界 " * 40),
    ]
    for event in events:
        renderer.handle(event)
    renderer.refresh()
    renderer.handle(finish(0, "first branch with a long label", numbered_lines(30), 30))
    renderer.handle(finish(1, "b", "世界 " * 40, 40))
    renderer.handle(done())
    printed = screen_text(stdout.getvalue())
    assert "line 00" in printed and "line 29" in printed


def test_live_prints_every_full_answer_after_done_and_the_summary_on_stderr(live):
    renderer, stdout, stderr = live()
    for event in [
        start("a", "b"),
        finish(1, "b", numbered_lines(50), 50),
        finish(0, "a", "short", 1),
        done(generated=51),
    ]:
        renderer.handle(event)
    after_live = screen_text(stdout.getvalue().rsplit("\x1b[?25h", 1)[-1])
    assert after_live == "## a\nshort\n\n## b\n" + numbered_lines(50) + "\n\n"
    assert screen_text(stderr.getvalue()).strip().replace("\n", "") == (  # the line wraps on the test's screen
        "2 branches · 51 tokens in 2 steps · 1.0 s (prefill 0.2 s, decode 0.8 s at 63.8 tok/s) · cache peak 11 tokens"
    )


def test_live_into_a_pipe_ends_its_final_frame_before_the_answers():
    # issue 53: `-o live | cat` printed "... lp -5.09## Who owns the bakery?"
    stdout, stderr = io.StringIO(), io.StringIO()
    pipe = Console(file=stdout, force_terminal=False, width=80, color_system=None)
    renderer = LiveRenderer(pipe, Console(file=stderr, force_terminal=False, width=80), header="tiny · cpu")
    for event in [start("a", "b"), finish(0, "a", "short", 1), finish(1, "b", "long", 1), done(generated=2)]:
        renderer.handle(event)
    lines = stdout.getvalue().splitlines()
    assert "## a" in lines and "## b" in lines  # each heading on a line of its own
    assert lines.index("## a") == 3  # the header and the two status lines, then the answers


def test_the_cut_note_names_a_few_answers_and_counts_the_rest():
    # issue 53: 2,000 paths cut by -n 2 were all named, on one ~25 KB line
    from mdcli.render.base import cut_note

    stdout, stderr = io.StringIO(), io.StringIO()
    renderer = PlainRenderer(stdout, stderr)
    labels = [f"path {i}" for i in range(1, 2001)]
    for event in [start(*labels), *(finish(i, label, "x", 2, "length") for i, label in enumerate(labels)), done(4000)]:
        renderer.handle(event)
    [note] = [line for line in stderr.getvalue().splitlines() if line.startswith("note: ")]
    assert note == ("note: 2,000 answers stopped at -n 2 (cut short, marked …): 'path 1', 'path 2', 'path 3', "
                    "'path 4', 'path 5', 'path 6' and 1,994 more; raise -n for more")
    assert cut_note([]) is None


def test_quiet_leaves_out_the_cut_note_and_keeps_the_mark_on_stdout():
    stdout, stderr = io.StringIO(), io.StringIO()
    renderer = PlainRenderer(stdout, stderr, quiet=True)
    for event in [start("a"), finish(0, "a", "half", 2, "length"), done(2)]:
        renderer.handle(event)
    assert (stdout.getvalue(), stderr.getvalue()) == ("half …\n", "")
    for quiet in (True, False):
        stdout, stderr = io.StringIO(), io.StringIO()
        shown = choose_renderer("live", stdout=stdout, stderr=stderr, quiet=quiet, no_color=True)
        for event in [start("a"), finish(0, "a", "half", 2, "length"), done(2)]:
            shown.handle(event)
        shown.close()
        assert stdout.getvalue().endswith("half …\n")
        assert ("stopped at -n 2" in stderr.getvalue()) is not quiet


def test_live_interrupted_prints_partial_answers_and_says_interrupted(live):
    renderer, stdout, stderr = live()
    for event in [start("a", "b"), token(0, "half an ans"), finish(1, "b", "whole")]:
        renderer.handle(event)
    renderer.interrupted()
    after_live = screen_text(stdout.getvalue().rsplit("\x1b[?25h", 1)[-1])
    assert after_live == "## a\nhalf an ans\n\n## b\nwhole\n\n"
    assert "interrupted" in stderr.getvalue()


def test_live_prints_answers_once_when_done_follows_ctrl_c(live):
    renderer, stdout, stderr = live()
    for event in [start("a"), token(0, "partial")]:
        renderer.handle(event)
    renderer.interrupted()
    renderer.handle(done(interrupted=True))
    renderer.interrupted()
    assert screen_text(stdout.getvalue()).count("partial") == 1
    assert stderr.getvalue().count("interrupted") == 1


def test_live_shows_control_characters_as_symbols_so_the_display_stays_intact(live):
    renderer, stdout, _ = live()
    renderer.handle(start("a"))
    renderer.handle(token(0, "clear\x1b[2Jscreen\rbell\x07"))
    renderer.refresh()
    assert "clear\u241b[2Jscreen\u240dbell\u2407" in last_frame(stdout.getvalue())


def test_live_subtitle_shows_the_beam_score_when_the_strategy_gives_one(live):
    renderer, stdout, _ = live(width=100)
    renderer.handle(start("beam0", "beam1"))
    scored = Finish(
        branch=0,
        label="beam0",
        text="x",
        token_ids=[7],
        finish_reason="stop",
        cumulative_logprob=-1.5,
        score=-0.75,
    )
    renderer.handle(scored)
    assert "score -0.75" in last_frame(stdout.getvalue())


def test_live_close_is_idempotent_and_safe_before_start(live):
    renderer, _, _ = live()
    renderer.close()
    renderer.close()
    renderer, _, _ = live()
    renderer.handle(start("a"))
    renderer.close()
    renderer.close()


def test_tail_lines_keeps_the_last_lines_wrapped_at_the_panel_width():
    console = Console(file=io.StringIO(), width=80)
    lines = tail_lines(console, "word " * 50 + "\nlast line here", width=12, lines=3)
    assert len(lines) == 3
    assert [line.plain.rstrip() for line in lines] == ["word word", "last line", "here"]
    assert all(line.cell_len <= 12 for line in lines)


def test_plan_grid_uses_one_to_three_columns_by_width_and_shares_the_height():
    assert plan_grid(8, width=60, room=20).columns == 1
    assert plan_grid(8, width=80, room=20).columns == 2
    assert plan_grid(8, width=200, room=20).columns == 3
    assert plan_grid(2, width=200, room=20).columns == 2
    grid = plan_grid(4, width=80, room=20)
    assert grid.height == 10 and 2 * grid.width + 1 <= 80
    assert plan_grid(50, width=20, room=2).height == MIN_PANEL_HEIGHT


# --- choosing a renderer -----------------------------------------------------------------------


def choose(mode, stdout, **kwargs):
    return choose_renderer(
        mode, stdout=stdout, stderr=io.StringIO(), quiet=False, no_color=False, **kwargs
    )


def test_choose_renderer_auto_is_plain_when_stdout_is_not_a_terminal():
    assert isinstance(choose("auto", io.StringIO()), PlainRenderer)


def test_choose_renderer_auto_is_live_on_a_terminal_and_explicit_modes_win():
    renderer = choose("auto", TerminalStringIO())
    assert isinstance(renderer, LiveRenderer)
    renderer.close()
    assert isinstance(choose("live", io.StringIO()), LiveRenderer)
    assert isinstance(choose("plain", TerminalStringIO()), PlainRenderer)
    assert isinstance(choose("jsonl", TerminalStringIO()), JsonlRenderer)


def run_live_on_fake_terminal(no_color: bool) -> str:
    stdout = TerminalStringIO()
    renderer = choose_renderer(
        "auto", stdout=stdout, stderr=TerminalStringIO(), quiet=False, no_color=no_color
    )
    for event in [
        start("a", "b"),
        token(0, "x"),
        finish(0, "a", "x"),
        finish(1, "b", "y"),
    ]:
        renderer.handle(event)
    renderer.refresh()
    renderer.handle(done())
    return stdout.getvalue()


def test_live_output_has_color_codes_on_a_color_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert SGR_ESCAPE.search(run_live_on_fake_terminal(no_color=False))


def test_no_color_env_removes_every_color_and_style_code(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("TERM", "xterm-256color")
    assert not SGR_ESCAPE.search(run_live_on_fake_terminal(no_color=False))


def test_no_color_flag_removes_every_color_and_style_code(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert not SGR_ESCAPE.search(run_live_on_fake_terminal(no_color=True))


# --- margins: blocks per question, branches grouped by question ----------------------------------


def margins_run(show_margins: bool = False):
    """Two questions over two segments: margins 0-3 (q1: 0, 1; q2: 2, 3), classifications 4-7,
    answers 8 (q1) and 9 (q2); q2's answer finishes first; q1 kept segment 1 only."""
    groups = ["Who?", "Who?", "Why?", "Why?"]
    labels = ["q1 segment 1/2", "q1 segment 2/2", "q2 segment 1/2", "q2 segment 2/2"]
    events = [
        Start(model="tiny", device="cpu", dtype="float32", dtype_reason="exact", attn="sdpa", strategy="margins",
              seed=None, branches=[BranchInfo(i, labels[i], [1, 2], group=groups[i]) for i in range(4)]),
        *(finish(i, labels[i], f"margin {i}") for i in range(4)),
        *(Fork(BranchInfo(4 + i, labels[i].replace("segment", "classification"), [1], group=groups[i]))
          for i in range(4)),
    ]
    for i in range(4):
        events.append(finish(4 + i, labels[i].replace("segment", "classification"), "NO#off topic" if i == 1 else "YES#"))
        verdict = {"relevant": i != 1, "reason": "off topic" if i == 1 else ""}
        events.append(Note("classification", "...", {"branch": 4 + i, "margin_branch": i, "question": 1 + i // 2,
                                                     **verdict}))
    events += [Fork(BranchInfo(8, "Who?", [1], group="Who?")), Fork(BranchInfo(9, "Why?", [1], group="Why?"))]
    sources = {"branch": 9, "question": 2, "segments": [1, 2], "margin_branches": [2, 3]}
    events += [Note("answer-sources", "...", sources), finish(9, "Why?", "Because.")]
    stdout, stderr = io.StringIO(), io.StringIO()
    renderer = PlainRenderer(stdout, stderr, quiet=True, show_margins=show_margins)
    for event in events:
        renderer.handle(event)
    return renderer, stdout


def test_plain_margins_prints_one_block_per_question_in_question_order():
    renderer, stdout = margins_run()
    assert stdout.getvalue() == ""  # q2 is done, but q1 comes first
    renderer.handle(Note("answer-sources", "...", {"branch": 8, "question": 1, "segments": [1], "margin_branches": [0]}))
    renderer.handle(finish(8, "Who?", "Falcon."))
    assert stdout.getvalue() == "## Who?\nFalcon.\n\n## Why?\nBecause.\n\n"


def test_plain_margins_with_show_margins_lists_each_margin_and_whether_it_was_kept():
    renderer, stdout = margins_run(show_margins=True)
    renderer.handle(Note("answer-sources", "...", {"branch": 8, "question": 1, "segments": [1], "margin_branches": [0]}))
    renderer.handle(finish(8, "Who?", "Falcon."))
    renderer.handle(done())
    assert stdout.getvalue() == (
        "## Who?\nFalcon.\n\n### margins (answer read 1 of 2)\n"
        "[segment 1/2] kept: margin 0\n[segment 2/2] left out (off topic): margin 1\n\n"
        "## Why?\nBecause.\n\n### margins (answer read 2 of 2)\n"
        "[segment 1/2] kept: margin 2\n[segment 2/2] kept: margin 3\n\n"
    )


def test_plain_margins_interrupted_prints_every_question_with_what_it_has():
    renderer, stdout = margins_run()
    renderer.handle(token(8, "Fal"))
    renderer.interrupted()
    assert stdout.getvalue() == "## Who?\nFal\n\n## Why?\nBecause.\n\n"


def test_grouped_branches_are_shown_together_in_the_order_their_groups_first_appear(live):
    renderer, stdout, _ = live(width=60, height=60)
    book = BranchBook()
    for event in [
        Start(model="m", device="cpu", dtype="float32", dtype_reason="", attn="sdpa", strategy="margins", seed=None,
              branches=[BranchInfo(0, "q1 s1", [1], group="A"), BranchInfo(1, "q2 s1", [1], group="B")]),
        Fork(BranchInfo(2, "q1 r1", [1], group="A")), Fork(BranchInfo(3, "q2 r1", [1], group="B")),
        Fork(BranchInfo(4, "free", [1])), Fork(BranchInfo(5, "A", [1], group="A")),
    ]:
        book.apply(event)
        renderer.handle(event)
    assert [b.label for b in book.in_tree_order()] == ["q1 s1", "q1 r1", "A", "q2 s1", "q2 r1", "free"]
    frame = last_frame(stdout.getvalue())
    assert frame.index("q1 r1") < frame.index("q2 s1")


def test_jsonl_branches_carry_their_group():
    info = BranchInfo(0, "q1 segment 1/2", [1, 2], group="Who?")
    renderer, stdout = run_jsonl([Start(model="m", device="cpu", dtype="float32", dtype_reason="", attn="sdpa",
                                        strategy="margins", seed=None, branches=[info]), done()])
    assert json.loads(stdout.getvalue().splitlines()[0])["branches"][0]["group"] == "Who?"
