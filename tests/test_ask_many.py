"""ask-many is exact: every answer's greedy tokens equal `model.generate` on that question's
prompt alone, on the real model and on tiny random models of several architectures."""

from __future__ import annotations

import pytest

from mdcli.api import ask_many, run_specs
from mdcli.core.decoding import BranchSpec
from mdcli.events import Done, Finish, Start
from mdcli.models.load import load_model
from tests.reference import generate_alone

STORY = (
    "Mara lived in a small lighthouse on the coast of Brittany. Every night she climbed the one hundred "
    "steps to light the great lamp. One stormy evening, a fishing boat named the Petrel lost its way in "
    "the fog. Mara rang the old bronze bell until the fishermen found the harbour. The next morning, the "
    "captain brought her a basket of fresh sardines to say thank you.\n"
)
QUESTIONS = [
    "Who is the main character?",
    "Where does the story take place?",
    "What was the name of the boat?",
    "What did the captain bring?",
    "How many steps did Mara climb?",
    "What was the weather like?",
    "What did Mara ring?",
    "Why did the captain bring a gift?",
]



def assert_each_branch_equals_generate(model, events):
    start = next(e for e in events if isinstance(e, Start))
    prompts = {b.id: b.prompt_token_ids for b in start.branches}
    finishes = [e for e in events if isinstance(e, Finish)]
    assert sorted(f.branch for f in finishes) == sorted(prompts)
    for finish in finishes:
        expected = generate_alone(model, prompts[finish.branch], len(finish.token_ids))
        assert finish.token_ids == expected, f"branch {finish.branch} ({finish.label})"


@pytest.mark.parametrize(
    ("copies", "questions"),
    [(1, 1), (4, 3), (12, 16)],
    ids=["~100-token document, 1 question", "~400 tokens, 3 questions", "~1,200 tokens, 16 questions"],
)
def test_every_answer_equals_generate_on_its_prompt_alone(embedded, copies, questions):
    document = STORY * copies
    asked = (QUESTIONS * 2)[:questions]
    events = list(ask_many(embedded, document, asked, max_new_tokens=24))
    assert_each_branch_equals_generate(embedded.model, events)
    done = events[-1]
    assert isinstance(done, Done)
    # the document entered the cache once, not once per question
    assert done.stats.prefill_tokens < done.stats.prompt_tokens / max(1, questions) + 40 * questions


def test_a_document_of_thousands_of_tokens_stays_exact(embedded):
    document = STORY * 30  # about 2,400 tokens
    events = list(ask_many(embedded, document, QUESTIONS[:4], max_new_tokens=16))
    start = events[0]
    assert len(start.branches[0].prompt_token_ids) > 2000
    assert_each_branch_equals_generate(embedded.model, events)


def test_prompt_token_ids_are_the_chat_templated_question_prompt(embedded):
    events = list(ask_many(embedded, STORY, ["Who?"], max_new_tokens=2))
    text = embedded.tokenizer.decode(events[0].branches[0].prompt_token_ids)
    assert text.startswith("<|im_start|>system")
    assert STORY.strip() in text and "Question: Who?" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "mistral", "gemma3"])
def test_branches_finishing_at_different_times_stay_exact_after_compaction(tiny_dir, arch, attn):
    lm = load_model(str(tiny_dir(arch)), attn=attn, quiet=True)
    document = STORY * 2
    specs = []
    for i, question in enumerate(QUESTIONS[:5]):
        ids = lm.tokenizer(f"{document}\nQ: {question}\nA:")["input_ids"]
        specs.append(BranchSpec(label=question, prompt_ids=list(ids), max_new_tokens=4 + 5 * i))
    events = list(run_specs(lm, specs, strategy="test", compact_ratio=0.0))
    assert events[-1].stats.compactions >= 3
    assert_each_branch_equals_generate(lm.model, events)


def test_sampled_branches_do_not_depend_on_which_other_branches_exist(embedded):
    from mdcli.core.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7)

    def answers(questions):
        events = ask_many(embedded, STORY, questions, sampling=sampling, max_new_tokens=12)
        return {e.label: e.token_ids for e in events if isinstance(e, Finish)}

    alone = answers(QUESTIONS[:1])
    together = answers(QUESTIONS[:1] + QUESTIONS[4:7])
    assert together[QUESTIONS[0]] == alone[QUESTIONS[0]]


def test_token_events_concatenate_to_the_finished_text(embedded):
    events = list(ask_many(embedded, STORY, QUESTIONS[:3], max_new_tokens=20, stop=("Petrel",)))
    for finish in (e for e in events if isinstance(e, Finish)):
        streamed = "".join(e.text for e in events if e.type == "token" and e.branch == finish.branch)
        assert streamed == finish.text
        assert "Petrel" not in finish.text


def test_a_stop_string_is_cut_with_the_whitespace_before_it_and_the_stream_agrees(embedded):
    # issue 53: --stop Plumb left "Harriet " with its trailing space
    from mdcli.core.detok import StreamingDetokenizer

    for text, stop, answer in [("Harriet Plumb keeps the shop.", "Plumb", "Harriet"),
                               ("One.\n\nTwo.", "\n\nTwo", "One."),
                               ("Harriet  is here ", "Plumb", "Harriet  is here ")]:  # no stop: every space kept
        detok = StreamingDetokenizer(embedded.tokenizer, stop=(stop,))
        streamed = "".join(detok.add(token) for token in embedded.tokenizer.encode(text))
        streamed += detok.finish()
        assert streamed == detok.final_text == answer
