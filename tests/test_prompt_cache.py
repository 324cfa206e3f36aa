"""The prompt cache on disk is exact and safe.

Exact: a run that reads a document's keys and values from the cache gives every branch the
tokens of the same run without it, token for token, and logits within 1e-4 of the branch's
prompt run alone, on the embedded model and tiny models of several architectures (a
sliding-window one among them, with a prefix far longer than its window); a prompt that extends a
cached prefix reuses what it shares; another dtype or model never reads the entry.

Safe: a truncated, corrupted or foreign file is skipped with one note and the run's tokens do not
change; two processes writing one entry leave one good entry; the folder stays under its cap,
least recently used first; nothing outside it is read.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mdcli import api
from mdcli.api import ask_many, run_specs
from mdcli.cli.app import app
from mdcli.core.decoding import BranchSpec
from mdcli.core.engine import Engine, run_to_end
from mdcli.prefixes import common_prefix_length
from mdcli.core.run import Run
from mdcli.events import Finish, Note, Token
from mdcli.models.load import load_model
from mdcli.prompt_cache.store import MIN_TOKENS, PromptStore, entry_files
from tests.reference import generate_alone

STORY = (
    "Mara lived in a small lighthouse on the coast of Brittany. Every night she climbed the one hundred "
    "steps to light the great lamp. One stormy evening, a fishing boat named the Petrel lost its way.\n"
)
QUESTIONS = ["Who is the main character?", "What was the boat called?", "Where does it take place?"]
NEW_QUESTIONS = ["What did Mara climb?", "When did the boat get lost?"]


def shared_length(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares (each prompt's last token excluded)."""
    return min(min(common_prefix_length(prompts[0], p) for p in prompts), min(len(p) for p in prompts) - 1)


def answers(events) -> dict[str, list[int]]:
    return {e.label: e.token_ids for e in events if isinstance(e, Finish)}


def logprobs(events) -> list[float]:
    return [e.logprob for e in events if isinstance(e, Token)]


def notes(events) -> list[Note]:
    return [e for e in events if isinstance(e, Note)]


def stats(events):
    return events[-1].stats


def tiny_specs(lm, document: str, questions: list[str], new_tokens: int = 6) -> list[BranchSpec]:
    return [BranchSpec(label=q, prompt_ids=lm.tokenizer(f"{document}\nQ: {q}\nA:")["input_ids"],
                       max_new_tokens=new_tokens) for q in questions]


@pytest.fixture(scope="module")
def cached_embedded(embedded, tmp_path_factory):
    """The embedded model's weights with a prompt cache of this module's."""
    folder = tmp_path_factory.mktemp("embedded-prompt-cache")
    return load_model(quiet=True, prompt_cache=str(folder)), folder


# -- exact ----------------------------------------------------------------------------------------


def test_a_second_run_reads_the_document_from_the_cache_and_its_tokens_do_not_change(embedded, cached_embedded):
    lm, _ = cached_embedded
    document = STORY * 4
    plain = list(ask_many(embedded, document, QUESTIONS, max_new_tokens=12))
    first = list(ask_many(lm, document, QUESTIONS, max_new_tokens=12))
    second = list(ask_many(lm, document, QUESTIONS, max_new_tokens=12))
    assert stats(first).cached_tokens == 0
    shared = shared_length([b.prompt_token_ids for b in second[0].branches])
    assert stats(second).cached_tokens == shared > MIN_TOKENS
    assert stats(second).prefill_tokens == stats(plain).prefill_tokens - shared
    assert answers(first) == answers(second) == answers(plain)
    assert logprobs(second) == pytest.approx(logprobs(plain), abs=1e-4)
    assert notes(first) == notes(second) == []


def test_new_questions_about_a_cached_document_reuse_it_and_equal_generate(embedded, cached_embedded):
    lm, _ = cached_embedded
    document = STORY * 3
    list(ask_many(lm, document, QUESTIONS[:2], max_new_tokens=4))
    events = list(ask_many(lm, document, NEW_QUESTIONS, max_new_tokens=10))
    assert stats(events).cached_tokens > len(embedded.tokenizer(document)["input_ids"])
    prompts = {b.label: b.prompt_token_ids for b in events[0].branches}
    for label, tokens in answers(events).items():
        assert tokens == generate_alone(embedded.model, prompts[label], len(tokens)), label


def test_speculation_over_a_cached_prefix_gives_the_same_tokens(embedded, cached_embedded):
    lm, _ = cached_embedded
    document = STORY * 5
    plain = list(ask_many(embedded, document, QUESTIONS, max_new_tokens=24, speculate=3))
    list(ask_many(lm, document, QUESTIONS, max_new_tokens=2, speculate=3))
    cached = list(ask_many(lm, document, QUESTIONS, max_new_tokens=24, speculate=3))
    assert stats(cached).cached_tokens > 0 and stats(cached).draft_tokens > 0
    assert answers(cached) == answers(plain)


STRATEGIES = {
    "beam": lambda lm, text: api.beam_search(lm, text + "\nSummarize the text above.", width=3, max_new_tokens=6),
    "think": lambda lm, text: api.think(lm, text + "\nWhy did the boat get lost?", paths=2, max_new_tokens=6,
                                        conclusion_tokens=6),
    "margins": lambda lm, text: api.margins(lm, text, "Who keeps the lighthouse?", segment_tokens=120,
                                            max_new_tokens=6, classify_tokens=4, answer_tokens=6),
    "explore": lambda lm, text: api.explore(lm, text + "\nWhat happens next?", k=2, max_new_tokens=8,
                                                sampling=api.SamplingParams(temperature=0.8, seed=3)),
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_reads_its_first_prefill_from_the_cache_with_the_same_tokens(embedded, cached_embedded,
                                                                                     strategy):
    lm, _ = cached_embedded
    document = STORY * 3
    plain = list(STRATEGIES[strategy](embedded, document))
    list(STRATEGIES[strategy](lm, document))
    cached = list(STRATEGIES[strategy](lm, document))
    assert stats(cached).cached_tokens >= MIN_TOKENS
    assert answers(cached) == answers(plain) and notes(cached) == notes(plain)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "mistral", "gemma3"])
def test_each_architecture_reads_its_prefix_back_exactly(tiny_dir, tmp_path, arch):
    """mistral and gemma3 have an 8-token sliding window: the cached prefix is many windows long."""
    lm = load_model(str(tiny_dir(arch)), quiet=True, prompt_cache=str(tmp_path))
    plain = dataclasses.replace(lm, prompt_store=None)
    specs = tiny_specs(lm, STORY * 2, QUESTIONS)
    reference = list(run_specs(plain, specs, strategy="test"))
    list(run_specs(lm, specs, strategy="test"))
    cached = list(run_specs(lm, specs, strategy="test"))
    assert stats(cached).cached_tokens >= MIN_TOKENS
    assert answers(cached) == answers(reference)
    for spec in specs:
        assert answers(cached)[spec.label] == generate_alone(lm.model, spec.prompt_ids, 6), spec.label


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prefill_logits_over_a_cached_prefix_equal_each_prompt_alone(tiny_dir, tmp_path, arch):
    lm = load_model(str(tiny_dir(arch)), quiet=True, prompt_cache=str(tmp_path))
    prompts = [spec.prompt_ids for spec in tiny_specs(lm, STORY * 2, QUESTIONS)]
    for _ in range(2):  # the first run writes the entry, the second reads it
        run = Run(Engine(lm.forward, sliding_window=lm.sliding_window, mixed_layer_types=lm.mixed_layer_types),
                  prompt_store=lm.prompt_store)
        results = run_to_end(run.prefill(prompts, "prefill"))
        for prompt, result in zip(prompts, results):
            with torch.inference_mode():
                alone = lm.model(torch.tensor([prompt])).logits[0, -1].float()
            assert torch.allclose(result.logits, alone, atol=1e-4)
    assert run.counters.cached_tokens == shared_length(prompts)


def test_a_prompt_extending_a_cached_prefix_reuses_the_part_it_shares(tiny_dir, tmp_path):
    lm = load_model(str(tiny_dir("llama")), quiet=True, prompt_cache=str(tmp_path))
    alone = tiny_specs(lm, STORY * 2, QUESTIONS[:1])
    list(run_specs(lm, alone, strategy="test"))  # keeps the whole first prompt but its last token
    specs = tiny_specs(lm, STORY * 2, NEW_QUESTIONS)
    events = list(run_specs(lm, specs, strategy="test"))
    assert stats(events).cached_tokens == common_prefix_length(alone[0].prompt_ids, specs[0].prompt_ids)
    assert answers(events) == answers(list(run_specs(dataclasses.replace(lm, prompt_store=None), specs,
                                                     strategy="test")))


def test_another_dtype_or_model_misses_the_cache(tiny_dir, tmp_path):
    first = load_model(str(tiny_dir("llama")), quiet=True, prompt_cache=str(tmp_path))
    specs = tiny_specs(first, STORY * 2, QUESTIONS)
    list(run_specs(first, specs, strategy="test"))
    assert stats(list(run_specs(first, specs, strategy="test"))).cached_tokens > 0
    bf16 = load_model(str(tiny_dir("llama")), quiet=True, dtype="bfloat16", prompt_cache=str(tmp_path))
    assert stats(list(run_specs(bf16, specs, strategy="test"))).cached_tokens == 0
    other = load_model(str(tiny_dir("qwen2")), quiet=True, prompt_cache=str(tmp_path))
    assert stats(list(run_specs(other, tiny_specs(other, STORY * 2, QUESTIONS), strategy="test"))).cached_tokens == 0
    assert len({first.prompt_store.namespace, bf16.prompt_store.namespace, other.prompt_store.namespace}) == 3


# -- safe -----------------------------------------------------------------------------------------


@pytest.fixture()
def cached_llama(tiny_dir, tmp_path):
    """A tiny llama with a cache holding one entry, the specs that wrote it and their plain answers."""
    lm = load_model(str(tiny_dir("llama")), quiet=True, prompt_cache=str(tmp_path))
    specs = tiny_specs(lm, STORY * 2, QUESTIONS)
    written = list(run_specs(lm, specs, strategy="test"))
    [entry] = entry_files(lm.prompt_store.entries)
    return lm, specs, answers(written), entry


def damage_truncate(entry: Path) -> None:
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size * 2 // 3])


def damage_flip_bytes(entry: Path) -> None:
    data = bytearray(entry.read_bytes())
    for i in range(len(data) - 64, len(data) - 32):
        data[i] ^= 0x5A
    entry.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip_bytes], ids=["truncated", "corrupted"])
def test_a_damaged_entry_is_skipped_with_one_note_and_the_tokens_do_not_change(cached_llama, damage):
    lm, specs, expected, entry = cached_llama
    damage(entry)
    events = list(run_specs(lm, specs, strategy="test"))
    assert answers(events) == expected
    [note] = notes(events)
    assert note.kind == "prompt-cache" and entry.name in note.message and "\n" not in note.message
    assert stats(events).cached_tokens == 0
    again = list(run_specs(lm, specs, strategy="test"))  # the bad entry was replaced by a good one
    assert notes(again) == [] and stats(again).cached_tokens > 0 and answers(again) == expected


def test_a_foreign_file_in_the_folder_is_ignored_with_one_note(cached_llama):
    lm, specs, expected, entry = cached_llama
    entry.unlink()
    foreign = lm.prompt_store.entries / "someone-elses.safetensors"
    foreign.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}        ")
    events = list(run_specs(lm, specs, strategy="test"))
    assert answers(events) == expected
    [note] = notes(events)
    assert "someone-elses.safetensors" in note.message and "not an mdcli prompt-cache entry" in note.message
    assert foreign.exists()  # not ours to remove


def test_a_link_in_the_folder_is_never_followed(cached_llama, tmp_path_factory):
    lm, specs, expected, entry = cached_llama
    outside = tmp_path_factory.mktemp("outside") / "entry.safetensors"
    entry.rename(outside)
    entry.symlink_to(outside)
    events = list(run_specs(lm, specs, strategy="test"))
    assert stats(events).cached_tokens == 0 and answers(events) == expected


def _write_entry(folder: str, seed: int, rounds: int) -> None:
    store = PromptStore(Path(folder), "n" * 32, model="m", dtype=torch.float32, cap_bytes=1 << 30)
    generator = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(1, 4, 512, 64, generator=generator), torch.randn(1, 4, 512, 64, generator=generator))
          for _ in range(8)]
    for _ in range(rounds):
        store.save(list(range(512)), kv)


def test_two_processes_writing_one_entry_leave_one_good_entry(tmp_path):
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_entry, args=(str(tmp_path), seed, 6)) for seed in (1, 2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
        assert writer.exitcode == 0
    store = PromptStore(tmp_path, "n" * 32, model="m", dtype=torch.float32, cap_bytes=1 << 30)
    assert len(entry_files(store.entries)) == 1
    assert [p.name for p in store.entries.iterdir() if p.name.endswith(".tmp")] == []
    hit = store.longest(list(range(600)))
    assert hit is not None and hit.tokens == 512 and store.take_notes() == []


def test_the_folder_keeps_under_its_cap_least_recently_used_first(tmp_path):
    kv = [(torch.zeros(1, 2, 100, 8), torch.zeros(1, 2, 100, 8))]  # 12,800 bytes of tensors
    store = PromptStore(tmp_path, "n" * 32, model="m", dtype=torch.float32, cap_bytes=40_000)
    prefixes = [[start] * 100 for start in (1, 2, 3)]
    for ids in prefixes[:2]:
        store.save(ids, kv)
    old = entry_files(store.entries)
    for path in old:
        os.utime(path, (1, 1))  # both long unused ...
    assert store.longest(prefixes[0]) is not None  # ... until the first is read again
    store.save(prefixes[2], kv)
    assert store.longest(prefixes[0]) is not None and store.longest(prefixes[2]) is not None
    assert store.longest(prefixes[1]) is None


def test_a_short_shared_prefix_is_neither_read_nor_kept(tiny_dir, tmp_path):
    lm = load_model(str(tiny_dir("llama")), quiet=True, prompt_cache=str(tmp_path))
    specs = tiny_specs(lm, "Mara.", QUESTIONS)
    list(run_specs(lm, specs, strategy="test"))
    assert entry_files(lm.prompt_store.entries) == []


# -- the command line -----------------------------------------------------------------------------


def test_cache_list_and_clear(cached_llama, tmp_path):
    lm, _, _, entry = cached_llama
    runner = CliRunner()
    listed = runner.invoke(app, ["cache", "list", "--prompt-cache", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    header, row = listed.stdout.splitlines()
    assert header.split()[:4] == ["model", "tokens", "size", "age"]
    assert lm.name in row and "Mara lived" in row
    kept = runner.invoke(app, ["cache", "clear", "--older-than", "7d", "--prompt-cache", str(tmp_path)])
    assert kept.exit_code == 0 and entry.exists() and "removed 0 entries" in kept.stderr
    cleared = runner.invoke(app, ["cache", "clear", "--prompt-cache", str(tmp_path)])
    assert cleared.exit_code == 0 and not entry.exists() and "removed 1 entry" in cleared.stderr
    empty = runner.invoke(app, ["cache", "list", "--prompt-cache", str(tmp_path)])
    assert empty.exit_code == 0 and empty.stdout == "" and "0 entries" in empty.stderr  # no table without rows
    bad = runner.invoke(app, ["cache", "clear", "--older-than", "soon", "--prompt-cache", str(tmp_path)])
    assert bad.exit_code == 2 and "--older-than 'soon' is not a duration" in bad.stderr


def test_entries_another_thread_count_keeps_apart_are_listed_with_their_thread_counts(tiny_dir, tmp_path):
    # issue 53, item 2: the thread count is in the key (a GEMM library may split its sums by thread),
    # and `cache list` showed two entries that looked identical
    threads = torch.get_num_threads()
    lms = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            lm = load_model(str(tiny_dir("llama")), quiet=True, prompt_cache=str(tmp_path))
            list(run_specs(lm, tiny_specs(lm, STORY * 2, QUESTIONS), strategy="test"))
            lms.append(lm)
    finally:
        torch.set_num_threads(threads)
    assert lms[0].prompt_store.namespace != lms[1].prompt_store.namespace
    listed = CliRunner().invoke(app, ["cache", "list", "--prompt-cache", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    rows = listed.stdout.splitlines()[1:]
    assert len(rows) == 2 and rows[0] != rows[1]
    assert sorted(row.split("  ")[0] for row in rows) == [f"{lms[0].name}, float32, 1 thread",
                                                           f"{lms[0].name}, float32, 2 threads"]


def test_one_models_entries_without_a_fact_that_differs_are_told_apart_by_namespace(tmp_path):
    kv = [(torch.zeros(1, 1, MIN_TOKENS, 4), torch.zeros(1, 1, MIN_TOKENS, 4))]
    # the same facts shown (another weights digest, say), and an entry from before the facts were kept
    for namespace, numerics in (("a" * 32, {"threads": "1"}), ("b" * 32, {"threads": "1"}), ("c" * 32, None)):
        store = PromptStore(tmp_path, namespace, model="m", dtype=torch.float32, cap_bytes=1 << 30,
                            numerics=numerics)
        store.save(list(range(MIN_TOKENS)), kv)
    models = sorted(entry.model for entry in api.prompt_cache_entries(str(tmp_path))[1])
    assert models == ["m, float32, namespace aaaaaaaa", "m, float32, namespace bbbbbbbb", "m, float32, namespace cccccccc"]


def test_a_prompt_cache_that_is_a_file_is_a_one_line_usage_error(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    story = tmp_path / "story.txt"
    story.write_text(STORY)
    result = CliRunner().invoke(app, ["ask-many", str(story), "-q", "Who?", "--prompt-cache", str(afile)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"mdcli: error: --prompt-cache '{afile}' is a file, not a folder; give auto, off or a folder")


def test_a_recipe_names_its_prompt_cache_and_the_flag_wins(tiny_dir, tmp_path):
    from mdcli.recipes import validate_recipe_data

    data = {"version": 1, "strategy": "ask-many", "context": {"input": True}, "questions": ["Who?"],
            "prompt_cache": False}
    assert validate_recipe_data(data, source="t").prompt_cache == "off"  # YAML's `prompt_cache: off`
    folder = tmp_path / "recipe-cache"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nstrategy: ask-many\ncontext: {{input: true}}\nprompt_cache: {folder}\n"
                      "questions: [Who is it, Where is it]\nsampling: {max_new_tokens: 2}\n")
    story = tmp_path / "story.txt"
    story.write_text(STORY * 2)
    model = str(tiny_dir("llama"))
    off = CliRunner().invoke(app, ["run", str(recipe), "-i", str(story), "-m", model, "--prompt-cache", "off"])
    assert off.exit_code == 0, off.output
    assert not folder.exists()
    on = CliRunner().invoke(app, ["run", str(recipe), "-i", str(story), "-m", model])
    assert on.exit_code == 0, on.output
    assert len([p for p in folder.rglob("*.safetensors")]) == 1
