"""Segmenting loses nothing and keeps to the budget, on the real SmolLM2 tokenizer.

The one unit that may exceed the budget is a single character (one code point) that alone
tokenizes to more tokens than the budget; with the minimum budget of 16 and a byte-level BPE
(at most 4 tokens per code point) that never happens, and the property test checks it anyway.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdcli.errors import UsageError
from mdcli.strategies.segmenting import MIN_SEGMENT_TOKENS, split_documents, split_text, token_counter
from tests.tiny_models import tiny_tokenizer


@pytest.fixture(scope="module")
def count():
    return token_counter(tiny_tokenizer())


def assert_lossless_and_within_budget(text: str, segments, budget: int, count) -> None:
    assert "".join(s.text for s in segments) == text
    for s in segments:
        assert s.text, "no empty segment"
        assert s.tokens == count(s.text)
        assert s.tokens <= budget or len(s.text) == 1, f"{s.tokens} tokens > {budget}: {s.text!r}"


# -- random documents of every awkward kind ---------------------------------------------------

_WORDS = st.sampled_from(
    ["budget", "project", "the", "über", "naïve", "São", "Ωμέγα", "данные", "東京", "漢字テキスト", "😀",
     "👨‍👩‍👧", "🇫🇷", "é", "x" * 40, "https://example.com/a/very/long/path?with=query&and=more",
     "a\u0301\u0302", "\u200d", "\ufeff", "12,000", "—"]
)
_SEPARATORS = st.sampled_from(
    [" ", " ", " ", "  ", ". ", "! ", "? ", "… ", "。", "！", "\n", "\r\n", "\n\n", "\r\n\r\n", "\n\n\n\n\n",
     " \n \n ", "\t", "\u3000", "", '." ', ".) "]
)
_TOKENS = st.one_of(_WORDS, _SEPARATORS, st.text(min_size=1, max_size=30))
documents = st.lists(_TOKENS, min_size=1, max_size=160).map("".join)
budgets = st.integers(min_value=MIN_SEGMENT_TOKENS, max_value=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=documents, budget=budgets)
def test_no_text_is_lost_and_every_segment_fits(count, text, budget):
    segments = split_text(text, budget, count)
    assert_lossless_and_within_budget(text, segments, budget, count)


@settings(max_examples=40, deadline=None)
@given(
    word=st.text(alphabet=st.characters(codec="utf-8"), min_size=200, max_size=600),
    budget=budgets,
)
def test_a_run_without_any_boundary_is_cut_inside_and_kept_whole(count, word, budget):
    segments = split_text(word, budget, count)
    assert_lossless_and_within_budget(word, segments, budget, count)


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(documents.filter(str.strip), min_size=1, max_size=4), budget=budgets)
def test_several_documents_are_separate_groups(count, texts, budget):
    segments = split_documents(texts, budget, count)
    for index, text in enumerate(texts):
        group = [s for s in segments if s.document == index]
        assert "".join(s.text for s in group) == text
        assert group[-1].ends_at == "end"
    assert [s.document for s in segments] == sorted(s.document for s in segments)


# -- where the cuts go ------------------------------------------------------------------------


def test_cuts_prefer_paragraphs_then_sentences(count):
    paragraph = "Alpha beta gamma delta. " * 6
    text = (paragraph.strip() + "\n\n") * 4
    segments = split_text(text, count(paragraph) + 4, count)
    assert_lossless_and_within_budget(text, segments, count(paragraph) + 4, count)
    assert all(s.ends_at in ("paragraph", "end") for s in segments)
    assert all(s.text.endswith("\n\n") for s in segments)


def test_the_sentence_that_overflows_a_segment_is_kept_not_dropped(count):
    # the published chunker appends a segment and drops the sentence that did not fit
    sentences = [f"Sentence number {i} talks about the harbour." for i in range(30)]
    text = " ".join(sentences)
    segments = split_text(text, 40, count)
    assert "".join(s.text for s in segments) == text
    for sentence in sentences:
        assert any(sentence in s.text for s in segments)
    assert all(s.ends_at in ("sentence", "end") for s in segments)


def test_a_sentence_longer_than_the_budget_is_cut_between_words(count):
    long_sentence = " ".join(["word"] * 200) + "."
    segments = split_text(long_sentence, 32, count)
    assert_lossless_and_within_budget(long_sentence, segments, 32, count)
    assert len(segments) > 1
    assert all(s.ends_inside_sentence for s in segments[:-1])
    assert all(s.ends_at == "word" for s in segments[:-1])


def test_cjk_sentences_end_without_spaces(count):
    text = "東京は日本の首都です。" * 40
    segments = split_text(text, 30, count)
    assert_lossless_and_within_budget(text, segments, 30, count)
    assert all(s.text.endswith("。") for s in segments)


def test_emoji_sequences_and_crlf_are_not_torn_apart(count):
    family = "👨‍👩‍👧"
    text = family * 60
    segments = split_text(text, 20, count)
    assert_lossless_and_within_budget(text, segments, 20, count)
    assert all(len(s.text) % len(family) == 0 for s in segments)
    crlf = "line one\r\nline two\r\n" * 50
    for s in split_text(crlf, 16, count):
        assert not s.text.startswith("\n")


def test_windows_line_endings_and_blank_lines_survive(count):
    text = "\r\n\r\n\r\nTitle\r\n\r\n\r\n\r\nFirst paragraph here.\r\nSecond line.\r\n\r\n" * 12 + "\n\n\n"
    segments = split_text(text, 20, count)
    assert_lossless_and_within_budget(text, segments, 20, count)
    assert not any(s.text.strip() == "" for s in segments[1:-1])


def test_too_small_a_budget_and_empty_documents_are_usage_errors(count):
    with pytest.raises(UsageError, match="too small"):
        split_text("text", MIN_SEGMENT_TOKENS - 1, count)
    with pytest.raises(UsageError, match="empty"):
        split_documents(["fine", "  \n "], 64, count, names=["a.txt", "b.txt"])
