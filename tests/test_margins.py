"""`margins` is exact and reads what it claims: every margin, classification and answer equals
`model.generate` on its prompt alone, and each margin's prompt is the documented template over
exactly the segments its layout promises (chain: 1..i; independent: i alone)."""

from __future__ import annotations

import json
from string import Template

import pytest
import torch
from typer.testing import CliRunner

from mdcli.api import margins
from mdcli.cli.app import app
from mdcli.core.decoding import common_prefix_length
from mdcli.prefixes import trie_size
from mdcli.errors import UsageError
from mdcli.strategies.job import FieldError
from mdcli.events import Done, Finish, Fork, Note, Start, Token
from mdcli.models.load import load_model
from mdcli.models.memory import kv_bytes_per_token
from mdcli.recipes import load_recipe
from mdcli.core.sampling import SamplingParams
from mdcli.strategies.segmenting import split_documents, token_counter
from mdcli.strategies.margins import (
    ANSWER_TEMPLATE, CLASSIFICATION_CONSTRAINT, CLASSIFICATION_TEMPLATE, DOCUMENT_SEPARATOR, MARGIN_TEMPLATE,
    NO_NOTES, NOTE_SEPARATOR, NOTE_TEMPLATE, MarginResult, Margins, MarginsPrompts, new_decoder, parse_verdict, sources_note,
)
from tests.reference import generate_alone, generate_constrained
from tests.tiny_models import tiny_tokenizer

REPORT = (
    "Quarterly project report.\n\n"
    "Project Falcon built a new loading dock for the warehouse. The budget was 200,000 dollars. It went over "
    "budget by 40,000 dollars because steel prices rose in March.\n\n"
    "Project Heron upgraded the office network. It finished on time and under budget.\n\n"
    "The cafeteria introduced a new menu with more vegetarian dishes. Most employees like the change.\n\n"
    "Project Osprey replaced the payroll software. It went over budget by 25,000 dollars because the vendor "
    "charged for extra training days.\n"
)
PASSAGES = [
    "Falcon: the loading dock cost 240,000 dollars against a budget of 200,000, because steel prices rose.",
    "Heron: the network upgrade spent 80,000 of its 95,000 dollars and finished in May.",
    "Osprey: the payroll project overran by 25,000 dollars.\r\nThe vendor charged for extra training days.",
]
QUERY = "Which projects went over budget, and why?"
SMALL = dict(max_new_tokens=6, classify_tokens=5, answer_tokens=6)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core machine, two spinning OpenMP threads per process made
    these tests 7-20x slower (measured); the previous setting is restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir("llama")), quiet=True)



def announced(events) -> dict[int, list[int]]:
    prompts = {b.id: b.prompt_token_ids for e in events if isinstance(e, Start) for b in e.branches}
    prompts.update({e.branch.id: e.branch.prompt_token_ids for e in events if isinstance(e, Fork)})
    return prompts


def assert_every_branch_equals_generate(model, events) -> None:
    """Each branch against generate on its prompt alone; a classification (announced under
    CLASSIFICATION_CONSTRAINT) against generate under that constraint."""
    prompts = announced(events)
    constrained = {e.branch.id for e in events if isinstance(e, Fork) and e.branch.constraint is not None}
    assert all(e.branch.constraint == CLASSIFICATION_CONSTRAINT.describe() for e in events
               if isinstance(e, Fork) and e.branch.id in constrained)
    finishes = [e for e in events if isinstance(e, Finish)]
    assert sorted(f.branch for f in finishes) == sorted(prompts)
    for finish in finishes:
        if finish.branch in constrained:
            expected = generate_constrained(
                model, tiny_tokenizer(), prompts[finish.branch], CLASSIFICATION_CONSTRAINT, len(finish.token_ids)
            )
        else:
            expected = generate_alone(model, prompts[finish.branch], len(finish.token_ids))
        assert finish.token_ids == expected, f"branch {finish.branch} ({finish.label})"


def chat_ids(tokenizer, user_text: str) -> list[int]:
    """The documented prompt form, rebuilt here without mdcli: chat template, default system."""
    messages = [{"role": "user", "content": user_text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def expected_margin_prompts(
    tokenizer, documents: list[str], budget: int, layout: str, query: str = QUERY
) -> list[list[int]]:
    """chain: system + segments 1..i + instruction; independent: system + segment i + instruction."""
    segments = split_documents(documents, budget, token_counter(tokenizer))
    prompts = []
    for i, segment in enumerate(segments):
        if layout == "independent":
            context = segment.text.strip()
        else:
            per_document: dict[int, str] = {}
            for s in segments[: i + 1]:
                per_document[s.document] = per_document.get(s.document, "") + s.text
            context = DOCUMENT_SEPARATOR.join(t.strip() for t in per_document.values())
        prompts.append(chat_ids(tokenizer, Template(MARGIN_TEMPLATE).substitute(context=context, query=query)))
    return prompts


def of_type(events, kind):
    return [e for e in events if isinstance(e, kind)]


def notes(events, kind: str) -> list[Note]:
    return [e for e in events if isinstance(e, Note) and e.kind == kind]


# -- exactness and layout, on the real model and a tiny random one ------------------------------


@pytest.mark.parametrize("which", ["embedded", "tiny"])
def test_chain_margins_read_segments_one_to_i_and_every_branch_is_exact(which, embedded, tiny):
    lm = embedded if which == "embedded" else tiny
    events = list(margins(lm, REPORT, QUERY, segment_tokens=32, **SMALL))
    start = events[0]
    expected = expected_margin_prompts(lm.tokenizer, [REPORT], 32, "chain")
    assert len(start.branches) == len(expected) >= 4
    assert [b.prompt_token_ids for b in start.branches] == expected
    assert [b.label for b in start.branches] == [f"segment {i}/{len(expected)}" for i in range(1, len(expected) + 1)]
    assert_every_branch_equals_generate(lm.model, events)
    assert isinstance(events[-1], Done)


@pytest.mark.parametrize("which", ["embedded", "tiny"])
def test_independent_margins_read_their_own_passage_and_every_branch_is_exact(which, embedded, tiny):
    lm = embedded if which == "embedded" else tiny
    events = list(margins(lm, PASSAGES, QUERY, names=["a.txt", "b.txt", "c.txt"], segment_tokens=24, **SMALL))
    start = events[0]
    expected = expected_margin_prompts(lm.tokenizer, PASSAGES, 24, "independent")
    assert [b.prompt_token_ids for b in start.branches] == expected
    assert start.branches[-1].label.endswith("(c.txt)")
    text_of = [lm.tokenizer.decode(b.prompt_token_ids) for b in start.branches]
    assert "Falcon" in text_of[0] and "Heron" not in text_of[0] and "Osprey" not in text_of[0]
    assert_every_branch_equals_generate(lm.model, events)


def test_chain_prompts_extend_each_other_so_the_cache_holds_the_document_once(embedded):
    tokenizer = embedded.tokenizer
    document = REPORT * 3
    job = Margins(documents=[document], query=QUERY, segment_tokens=64, margin_tokens=1)
    segments = job.segments(tokenizer)
    specs = job.margin_specs(tokenizer, segments)
    prompts = [s.prompt_ids for s in specs]
    for i in range(len(prompts) - 1):
        shared = 0
        while prompts[i][shared] == prompts[i + 1][shared]:
            shared += 1
        # prompt i+1 starts with prompt i up to (within a token or two) the end of segment i
        assert job.margin_context(segments, i)[:-12] in tokenizer.decode(prompts[i][:shared])
    decoder = new_decoder(embedded)
    decoder.announce(specs)
    list(decoder.decode())
    prefilled = decoder.stats(0.0).prefill_tokens
    document_tokens = len(tokenizer(document, add_special_tokens=False)["input_ids"])
    instruction = len(chat_ids(tokenizer, Template(MARGIN_TEMPLATE).substitute(context="", query=QUERY)))
    assert prefilled == trie_size(prompts)
    assert prefilled <= document_tokens + len(prompts) * instruction
    assert prefilled < sum(len(p) for p in prompts) / 2


# -- the three phases and their events ---------------------------------------------------------


def test_events_announce_classify_and_source_the_answer(tiny):
    events = list(margins(tiny, REPORT, QUERY, segment_tokens=32, keep="all", **SMALL))
    margin_ids = [b.id for b in events[0].branches]
    forks = of_type(events, Fork)
    total = len(margin_ids)
    assert [f.branch.label for f in forks] == [f"classification {i}/{total}" for i in range(1, total + 1)] + ["answer"]
    classified = notes(events, "classification")
    assert [n.data["segment"] for n in classified] == list(range(1, len(margin_ids) + 1))
    assert [n.data["margin_branch"] for n in classified] == margin_ids
    for note in classified:
        assert set(note.data) == {
            "branch", "margin_branch", "question", "segment", "document", "relevant", "parsed", "reason", "constraint",
        }
        assert note.data["constraint"] is True and note.data["parsed"]  # decoded under (YES|NO)#: always a label
        if not note.data["parsed"]:
            assert note.data["relevant"] is True and "kept as relevant" in note.message
    answer = forks[-1].branch
    sources_index = next(i for i, e in enumerate(events) if isinstance(e, Note) and e.kind == "answer-sources")
    assert isinstance(events[sources_index + 1], Finish) and events[sources_index + 1].branch == answer.id
    assert events[sources_index].data == {
        "branch": answer.id, "question": 1, "segments": list(range(1, len(margin_ids) + 1)),
        "margin_branches": margin_ids,
    }
    done = events[-1]
    tokens = sum(len(f.token_ids) for f in of_type(events, Finish))
    assert done.stats.generated_tokens == tokens == len(of_type(events, Token))
    assert done.stats.prompt_tokens == sum(len(p) for p in announced(events).values())


def test_the_answer_prompt_is_the_documented_template_over_the_kept_margins(tiny):
    events = list(margins(tiny, REPORT, QUERY, segment_tokens=32, classify=False, **SMALL))
    assert not notes(events, "classification")
    margin_finishes = [f for f in of_type(events, Finish) if f.label.startswith("segment")]
    blocks = [Template(NOTE_TEMPLATE).substitute(label=f.label, margin=f.text.strip()) for f in margin_finishes]
    answer_text = Template(ANSWER_TEMPLATE).substitute(notes=NOTE_SEPARATOR.join(blocks), query=QUERY)
    expected = chat_ids(tiny.tokenizer, answer_text)
    [fork] = of_type(events, Fork)
    assert fork.branch.prompt_token_ids == expected
    assert_every_branch_equals_generate(tiny.model, events)


def test_classification_prompt_is_the_papers_and_with_segments_adds_the_source(tiny):
    events = list(margins(tiny, PASSAGES, QUERY, with_segments=True, keep="all", **SMALL))
    margin_finishes = {f.branch: f for f in of_type(events, Finish) if f.label.startswith("segment")}
    forks = of_type(events, Fork)
    first = next(iter(margin_finishes.values()))
    classify_text = Template(CLASSIFICATION_TEMPLATE).substitute(query=QUERY, margin=first.text.strip())
    expected = chat_ids(tiny.tokenizer, classify_text)
    assert forks[0].branch.prompt_token_ids == expected
    answer_text = tiny.tokenizer.decode(forks[-1].branch.prompt_token_ids)
    for passage in PASSAGES:
        assert passage.strip() in answer_text


def test_irrelevant_margins_are_left_out_of_the_answer_unless_keep_all(tiny):
    # The embedded 135M model never answers the paper's prompt in the YES#/NO# format (everything is
    # kept as relevant), so exclusion is checked on margins classified here by parse_verdict.
    segments = split_documents(PASSAGES, 64, token_counter(tiny.tokenizer))
    replies = ["YES#names Falcon", "NO#only Heron, on budget", "yes#Osprey overran"]
    results = []
    for number, (segment, reply) in enumerate(zip(segments, replies), 1):
        verdict = parse_verdict(reply)
        results.append(MarginResult(number, segment, f"segment {number}/3", branch=number - 1,
                                    text=f"margin {number}", relevant=verdict.relevant))
    relevant_only = Margins(documents=PASSAGES, query=QUERY)
    kept = relevant_only.kept(results)
    assert [m.number for m in kept] == [1, 3]
    prompt = relevant_only.answer_prompt(kept)
    assert "[segment 1/3] margin 1" in prompt and "margin 2" not in prompt and "[segment 3/3] margin 3" in prompt
    assert sources_note(7, kept).data == {"branch": 7, "question": 1, "segments": [1, 3], "margin_branches": [0, 2]}
    assert [m.number for m in Margins(documents=PASSAGES, query=QUERY, keep="all").kept(results)] == [1, 2, 3]
    assert [m.number for m in Margins(documents=PASSAGES, query=QUERY, classify=False).kept(results)] == [1, 2, 3]
    assert NO_NOTES in relevant_only.answer_prompt([])


@pytest.mark.parametrize(
    ("reply", "relevant", "parsed", "reason"),
    [
        ("YES#It names the projects.", True, True, "It names the projects."),
        ("NO#Not related.", False, True, "Not related."),
        ("  ```text\nyes # mentions Falcon\n```", True, True, "mentions Falcon"),
        ("**NO**#nothing about budgets", False, True, "nothing about budgets"),
        ("Answer: Yes, it does.", True, True, "it does."),
        ("The verdict is NO#the piece is about food", False, True, "the piece is about food"),
        ("Nope", True, False, "Nope"),
        ("YES#maybe NO#maybe not", True, True, "maybe NO#maybe not"),
        ("I think yes# or no#", True, False, "I think yes# or no#"),
        ("", True, False, ""),
    ],
)
def test_verdicts_are_read_robustly_and_default_to_relevant(reply, relevant, parsed, reason):
    verdict = parse_verdict(reply)
    assert (verdict.relevant, verdict.parsed, verdict.reason) == (relevant, parsed, reason)


# -- several questions in one forest ------------------------------------------------------------

QUESTIONS = [QUERY, "What did the cafeteria change?", "Which project finished on time?"]


def per_question(events) -> dict[str, list[list[int]]]:
    """Each question's branches' token ids by phase, in segment order: margins, classifications,
    answer (as a run of that question alone would list them)."""
    finishes = {f.branch: f.token_ids for f in of_type(events, Finish)}
    infos = [b for e in events if isinstance(e, Start) for b in e.branches]
    infos += [e.branch for e in events if isinstance(e, Fork)]
    phases: dict[str | None, list[list[int]]] = {}
    for info in infos:
        phases.setdefault(info.group, []).append(finishes[info.id])
    return phases


@pytest.mark.parametrize(
    ("which", "layout"), [("embedded", "chain"), ("embedded", "independent"), ("tiny", "chain"), ("tiny", "independent")]
)
def test_several_questions_every_margin_classification_and_answer_is_exact(which, layout, embedded, tiny):
    lm = embedded if which == "embedded" else tiny
    questions = QUESTIONS[:2] if which == "embedded" else QUESTIONS
    documents = [REPORT] if layout == "chain" else PASSAGES
    events = list(margins(lm, documents, questions=questions, segment_tokens=40, context=layout, **SMALL))
    start = events[0]
    count = len(expected_margin_prompts(lm.tokenizer, documents, 40, layout))
    assert len(start.branches) == len(questions) * count >= 6
    for q, question in enumerate(questions):
        mine = start.branches[q * count : (q + 1) * count]
        assert [b.prompt_token_ids for b in mine] == expected_margin_prompts(
            lm.tokenizer, documents, 40, layout, question
        )
        assert {b.group for b in mine} == {question}
        assert all(b.label.startswith(f"q{q + 1} segment ") for b in mine)
    forks = of_type(events, Fork)
    assert len(forks) == len(questions) * count + len(questions)
    assert [f.branch.label for f in forks[-len(questions):]] == questions
    assert_every_branch_equals_generate(lm.model, events)


@pytest.mark.parametrize(("arch", "layout"), [("gpt2", "chain"), ("qwen2", "independent"), ("gemma3", "chain")])
def test_several_questions_are_exact_on_other_architectures(tiny_dir, arch, layout):
    lm = load_model(str(tiny_dir(arch)), quiet=True)
    documents = [REPORT] if layout == "chain" else PASSAGES
    events = list(margins(lm, documents, questions=QUESTIONS[:2], segment_tokens=40, context=layout, **SMALL))
    assert len(events[0].branches) >= 4
    assert_every_branch_equals_generate(lm.model, events)


@pytest.mark.parametrize("layout", ["chain", "independent"])
def test_each_question_gets_exactly_the_tokens_of_a_run_of_its_own(tiny, layout):
    documents = [REPORT] if layout == "chain" else PASSAGES
    options = dict(segment_tokens=40, context=layout, keep="all", **SMALL)
    together = per_question(list(margins(tiny, documents, questions=QUESTIONS, **options)))
    for question in QUESTIONS:
        alone = per_question(list(margins(tiny, documents, question, **options)))
        assert together[question] == alone[question], question


def test_sampled_questions_draw_what_their_own_runs_draw(tiny):
    sampling = SamplingParams(temperature=1.0, seed=7)
    options = dict(segment_tokens=40, classify=False, sampling=sampling, **SMALL)
    together = per_question(list(margins(tiny, REPORT, questions=QUESTIONS[:2], **options)))
    for question in QUESTIONS[:2]:
        assert together[question] == per_question(list(margins(tiny, REPORT, question, **options)))[question]


def test_all_questions_share_one_copy_of_each_segment_in_the_cache(embedded):
    tokenizer = embedded.tokenizer
    four = Margins(documents=[REPORT], questions=[*QUESTIONS, "Who likes the new menu?"], segment_tokens=40)
    segments = four.segments(tokenizer)
    specs = four.margin_specs(tokenizer, segments)
    count = len(segments)
    for q in range(1, 4):
        for i in range(count):
            first, other = specs[i].prompt_ids, specs[q * count + i].prompt_ids
            shared = common_prefix_length(first, other)
            # every question's margin of segment i begins with the same tokens up to the end of
            # the context, so the cache holds that text once
            assert four.margin_context(segments, i)[-24:] in tokenizer.decode(first[:shared])
    document_tokens = sum(s.tokens for s in segments)
    # with the question first, each question stores the document again
    question_first = MarginsPrompts(margin="$query\n\n```\n$context\n```")
    assert question_first.question_first() and not MarginsPrompts().question_first()
    first = Margins(documents=[REPORT], questions=four.questions, segment_tokens=40, prompts=question_first)
    stored = trie_size([s.prompt_ids for s in first.margin_specs(tokenizer, segments)])
    assert stored >= 4 * document_tokens
    layout = notes(list(margins(embedded, REPORT, questions=QUESTIONS[:2], segment_tokens=40,
                                max_new_tokens=1, classify=False, answer_tokens=1)), "margins-layout")[0]
    assert layout.data["questions"] == QUESTIONS[:2] and layout.data["margins"] == 2 * count


def test_notes_name_the_question_and_each_answer_is_sourced_from_its_own_margins(tiny):
    events = list(margins(tiny, PASSAGES, questions=QUESTIONS[:2], keep="all", **SMALL))
    start = events[0]
    classified = notes(events, "classification")
    assert [n.data["question"] for n in classified] == [1, 1, 1, 2, 2, 2]
    assert [n.data["margin_branch"] for n in classified] == [b.id for b in start.branches]
    sources = notes(events, "answer-sources")
    assert [n.data["question"] for n in sources] == [1, 2]
    assert [n.data["margin_branches"] for n in sources] == [
        [b.id for b in start.branches[:3]], [b.id for b in start.branches[3:]],
    ]
    for note in sources:
        after = events[events.index(note) + 1]
        assert isinstance(after, Finish) and after.branch == note.data["branch"]


def test_too_many_questions_for_memory_are_refused_saying_how_many_fit(tiny):
    job = Margins(documents=PASSAGES, questions=QUESTIONS, **{"margin_tokens": 6})
    from mdcli.strategies.margins import cache_tokens

    segments = job.segments(tiny.tokenizer)
    specs = job.margin_specs(tiny.tokenizer, segments)
    per_token = kv_bytes_per_token(tiny.model.config, 4)
    two = cache_tokens(job, tiny.tokenizer, segments, specs, 2) * per_token
    run = margins(tiny, PASSAGES, questions=QUESTIONS, memory_budget_bytes=two + 1, max_new_tokens=6)
    with pytest.raises(UsageError, match=r"9 margins need about .* for 3 questions x 3 segments") as error:
        next(run)
    assert "ask at most 2 questions per run" in error.value.fix


def test_a_larger_segment_size_is_suggested_when_one_question_does_not_fit(tiny):
    document = REPORT * 4
    job = Margins(documents=[document], questions=QUESTIONS[:2], segment_tokens=32, margin_tokens=6)
    from mdcli.strategies.margins import cache_tokens

    bigger = Margins(documents=[document], questions=QUESTIONS[:2], segment_tokens=128, margin_tokens=6)
    segments = bigger.segments(tiny.tokenizer)
    per_token = kv_bytes_per_token(tiny.model.config, 4)
    room = cache_tokens(bigger, tiny.tokenizer, segments, bigger.margin_specs(tiny.tokenizer, segments), 2)
    with pytest.raises(UsageError, match="KV cache") as error:
        next(margins(tiny, document, questions=QUESTIONS[:2], segment_tokens=32, max_new_tokens=6,
                     memory_budget_bytes=room * per_token))
    assert "segment_tokens" in error.value.fix  # the API names the job's field (the command line: its flag)
    suggested = int(error.value.fix.split("segment_tokens ")[1].split()[0])
    assert job.segment_tokens < suggested <= 128


@pytest.mark.parametrize(
    ("questions", "needle"),
    [([QUERY, "  "], "question 2 is empty"), ([QUERY, "Why?", QUERY], "question 3 repeats question 1")],
)
def test_bad_questions_are_refused_before_the_model_runs(tiny, questions, needle):
    with pytest.raises(UsageError, match=needle):
        margins(tiny, REPORT, questions=questions)


# -- refusals and notes ------------------------------------------------------------------------


def test_a_cache_larger_than_memory_is_refused_before_any_forward(tiny):
    run = margins(tiny, PASSAGES * 4, QUERY, memory_budget_bytes=100_000)
    with pytest.raises(UsageError, match=r"12 margins need about .* of KV cache"):
        next(run)


def test_a_chain_longer_than_the_context_suggests_independent(tiny):
    long_document = "The quick brown fox jumps over the lazy dog. " * 260  # > 2,048 tokens
    with pytest.raises(UsageError, match="context") as error:
        next(margins(tiny, long_document, QUERY, segment_tokens=512))
    assert "layout independent" in error.value.fix  # the job's field (the command line: --context)
    assert isinstance(next(margins(tiny, long_document, QUERY, segment_tokens=512, context="independent")), Start)


def test_a_sentence_longer_than_a_segment_is_split_and_said_so(tiny):
    run_on = " ".join(["budget"] * 120) + "."
    events = list(margins(tiny, run_on, QUERY, segment_tokens=40, classify=False, max_new_tokens=1, answer_tokens=1))
    splits = notes(events, "segment-split")
    assert splits and all(n.data["ends_at"] == "word" for n in splits)
    assert len(splits) == len(events[0].branches) - 1


@pytest.mark.parametrize(
    ("documents", "query", "options", "needle"),
    [
        (["  \n"], QUERY, {}, "empty"),
        ([REPORT], "  ", {}, "query is missing"),
        ([REPORT], QUERY, {"segment_tokens": 8}, "too small"),
        ([REPORT], QUERY, {"context": "tree"}, "unknown context layout"),
        ([REPORT], QUERY, {"keep": "some"}, "unknown keep 'some'"),
    ],
)
def test_bad_input_is_a_usage_error_before_the_model_runs(tiny, documents, query, options, needle):
    with pytest.raises(UsageError, match=needle):
        margins(tiny, documents, query, **options)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"layout": "tree"}, "unknown context layout 'tree'"),
        ({"segment_tokens": 0}, "segment_tokens 0 is too small"),
        ({"classify_tokens": 0}, "classify_tokens must be at least 1"),
        ({"margin_tokens": -1}, "margin_tokens must be at least 1"),
    ],
)
def test_the_job_refuses_bad_fields_naming_them(fields, needle):
    with pytest.raises(FieldError, match=needle):
        Margins(documents=[REPORT], query=QUERY, **fields)


def test_the_api_runs_a_job_as_it_runs_the_same_keywords(tiny):
    job = Margins(documents=PASSAGES, questions=QUESTIONS[:2], layout="chain", segment_tokens=40, keep="all",
                  margin_tokens=6, classify_tokens=5, answer_tokens=6)
    from_keywords = margins(tiny, PASSAGES, questions=QUESTIONS[:2], context="chain", segment_tokens=40, keep="all",
                            **SMALL)
    def finished(events):
        return [(f.branch, f.label, f.token_ids) for f in of_type(events, Finish)]

    assert finished(list(margins(tiny, job))) == finished(list(from_keywords))
    with pytest.raises(TypeError, match="keep"):
        margins(tiny, job, keep="relevant")


# -- the command line --------------------------------------------------------------------------

runner = CliRunner()


def cli(*args: str, input: str | None = None):
    return runner.invoke(app, ["margins", *args], input=input, env={"HF_HUB_OFFLINE": "1"})


def test_cli_jsonl_streams_margins_classifications_and_the_answer(tiny_dir, tmp_path):
    paths = []
    for i, passage in enumerate(PASSAGES):
        paths.append(tmp_path / f"doc{i + 1}.txt")
        paths[-1].write_text(passage)
    result = cli(*map(str, paths), "-q", QUERY, "-m", str(tiny_dir("llama")), "--jsonl",
                 "-n", "3", "--classify-tokens", "3", "--answer-tokens", "3")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0]["type"] == "start" and lines[0]["strategy"] == "margins"
    assert [b["label"] for b in lines[0]["branches"]] == [f"segment {i}/3 (doc{i}.txt)" for i in (1, 2, 3)]
    kinds = [line.get("kind") for line in lines if line["type"] == "note"]
    assert kinds.count("classification") == 3 and kinds.count("answer-sources") == 1
    assert lines[-1]["type"] == "done" and lines[-2]["type"] == "answers"  # the answers line, then done
    assert lines[-3]["type"] == "finish" and lines[-3]["label"] == "answer"


def test_cli_reads_stdin_and_refuses_bad_input_in_one_line(tiny_dir, tmp_path):
    model = str(tiny_dir("llama"))
    ok = cli("-", "-q", QUERY, "-m", model, "-o", "plain", "--no-classify", "-n", "2", "--answer-tokens", "2",
             "--quiet", input=REPORT)
    assert ok.exit_code == 0, ok.output
    assert "##" not in ok.stdout and ok.stdout.endswith("\n")  # one question: the bare answer, as in ask-many
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    for args, needle in [
        ((str(empty), "-q", QUERY), "empty"),
        (("-", "-q", "  "), "query is missing"),
        (("-", "-"), "more than once"),
    ]:
        result = cli(*args, "-m", model, input=REPORT)
        assert result.exit_code == 2, result.output
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("mdcli: error: ") and needle in line
    assert cli("-", "-q", QUERY, "--segment-tokens", "4", input=REPORT).exit_code == 2


def test_cli_several_questions_print_a_block_per_question_with_its_margins_when_asked(tiny_dir, tmp_path):
    document = tmp_path / "report.txt"
    document.write_text(REPORT)
    more = tmp_path / "questions.txt"
    more.write_text(f"\n{QUESTIONS[1]}\n\n{QUESTIONS[2]}\n")
    common = (str(document), "-q", QUERY, "--questions-file", str(more), "-m", str(tiny_dir("llama")),
              "--segment-tokens", "64", "-n", "3", "--classify-tokens", "3", "--answer-tokens", "3")
    plain = cli(*common, "-o", "plain", "--quiet")
    assert plain.exit_code == 0, plain.output
    assert [line for line in plain.stdout.splitlines() if line.startswith("## ")] == [f"## {q}" for q in QUESTIONS]
    assert "### margins" not in plain.stdout
    shown = cli(*common, "-o", "plain", "--quiet", "--show-margins")
    blocks = shown.stdout.split("## ")[1:]
    assert len(blocks) == 3 * 2  # each question's "## question" and its "### margins"
    for question, (answer, listing) in zip(QUESTIONS, zip(blocks[::2], blocks[1::2])):
        assert answer.startswith(question + "\n")
        lines = listing.strip().splitlines()
        assert lines[0].startswith("margins (answer read ")
        assert [line.split("]")[0] for line in lines[1:]] == ["[segment 1/3", "[segment 2/3", "[segment 3/3"]
        assert all("] kept:" in line or "] left out" in line for line in lines[1:])
    jsonl = cli(*common, "--jsonl")
    lines = [json.loads(line) for line in jsonl.stdout.splitlines()]
    branches = lines[0]["branches"] + [line["branch"] for line in lines if line["type"] == "fork"]
    assert [b["group"] for b in branches[:9]] == [q for q in QUESTIONS for _ in range(3)]
    answers = [line for line in lines if line.get("kind") == "answer-sources"]
    assert sorted(a["data"]["question"] for a in answers) == [1, 2, 3]


def test_cli_save_recipe_round_trips_several_questions_to_the_same_tokens(tiny_dir, tmp_path):
    document = tmp_path / "report.txt"
    document.write_text(REPORT)
    saved = tmp_path / "m.yaml"
    model = str(tiny_dir("llama"))
    first = cli(str(document), "-q", QUERY, "-q", "Costs in $?", "-m", model, "--segment-tokens", "64",
                "--context", "independent", "-n", "3", "--classify-tokens", "2", "--answer-tokens", "3",
                "--speculate", "2", "--save-recipe", str(saved), "--jsonl")
    assert first.exit_code == 0, first.output
    recipe = load_recipe(saved)
    assert recipe.questions == [QUERY, "Costs in $$?"] and recipe.layout == "independent"
    assert recipe.speculate == 2  # every flag typed is in the recipe
    again = runner.invoke(app, ["run", str(saved), "--input", str(document), "-m", model, "--jsonl"],
                          env={"HF_HUB_OFFLINE": "1"})
    assert again.exit_code == 0, again.output

    def finishes(stdout):
        """Each branch's label and tokens, by branch id (guesses can change which finishes first)."""
        return {e["branch"]: (e["label"], e["token_ids"])
                for e in map(json.loads, stdout.splitlines()) if e["type"] == "finish"}

    assert finishes(again.stdout) == finishes(first.stdout) and len(finishes(first.stdout)) == 2 * 3 * 2 + 2
    two = tmp_path / "two.txt"
    two.write_text(PASSAGES[0])
    refused = cli(str(document), str(two), "-q", QUERY, "-m", model, "--save-recipe", str(tmp_path / "x.yaml"))
    assert refused.exit_code == 2 and "names several documents by their paths" in refused.stderr


def test_cli_save_recipe_over_a_folder_runs_again_on_it_to_the_same_tokens(tiny_dir, tmp_path):
    # issue 53: --save-recipe was refused for a folder
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(REPORT)
    (folder / "b.txt").write_text(PASSAGES[0])
    saved, model = tmp_path / "m.yaml", str(tiny_dir("llama"))
    first = cli(str(folder), "-q", QUERY, "-m", model, "--segment-tokens", "64", "-n", "3", "--classify-tokens", "2",
                "--answer-tokens", "3", "--speculate", "off", "--save-recipe", str(saved), "--jsonl")
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, ["run", str(saved), "--input", str(folder), "-m", model, "--jsonl"],
                          env={"HF_HUB_OFFLINE": "1"})
    assert again.exit_code == 0, again.output

    def finishes(stdout):
        return {e["branch"]: (e["label"], e["token_ids"])
                for e in map(json.loads, stdout.splitlines()) if e["type"] == "finish"}

    assert finishes(again.stdout) == finishes(first.stdout)
    assert any(f"({folder}/b.txt)" in label for label, _ in finishes(first.stdout).values())
