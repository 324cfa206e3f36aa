#!/usr/bin/env python3
"""Per-step cost of three constraint engines on CPU with the embedded model's tokenizer.

    PYTHONPATH=/tmp/cbench python benchmarks/constraints_engines.py --steps 300

llguidance, xgrammar and outlines-core each get the same regex and the same JSON schema and the
same walk: at every step the engine computes the next-token mask of the whole vocabulary (49,152
tokens, SmolLM2), the walk picks the allowed token with the highest score under one fixed random
score vector (a stand-in for logits, the same for every engine), and the engine consumes it; when
the constraint is complete (or only EOS is left) the matcher resets. Reported per engine and
constraint: the compile time (once per constraint; the tokenizer preparation, once per model, is
reported separately), and the mean / median time per step of computing the mask, and of consuming
the token. One thread (torch.set_num_threads(1); the engines' own Rust/C++ code is single-threaded
for one matcher). Only llguidance is a dependency of mdcli; the other two were installed with
`pip install --no-deps --target /tmp/cbench xgrammar outlines-core apache-tvm-ffi` for this
measurement. Results: docs/performance.md, "Constraint engines".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer

from mdcli.models.embedded import embedded_model_dir

REGEX = r"(yes|no|maybe)\. [A-Z][a-z]+( [a-z]+){2,12}\."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}


def walk(mask_fn, consume_fn, done_fn, reset_fn, scores: torch.Tensor, steps: int) -> tuple[list[float], list[float]]:
    """Times of computing the mask and of consuming the chosen token, per step."""
    masks, consumes = [], []
    for _ in range(steps):
        started = time.perf_counter()
        allowed = mask_fn()  # [V] bool
        masks.append(time.perf_counter() - started)
        token = int(scores.masked_fill(~allowed, float("-inf")).argmax())
        started = time.perf_counter()
        consume_fn(token)
        consumes.append(time.perf_counter() - started)
        if done_fn():
            reset_fn()
    return masks, consumes


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[W] int32 bit words -> [vocab] bool."""
    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return bits.flatten()[:vocab].bool()


def bench_llguidance(tok, vocab, scores, steps):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    prepare = time.perf_counter() - started
    results = {}
    for name, grammar in (("regex", llguidance.LLMatcher.grammar_from_regex(REGEX)),
                          ("json", llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))):
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - started
        assert not matcher.is_error(), matcher.get_error()
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

        def mask():
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            return unpack(bitmask[0], vocab)

        results[name] = (compile_s, *walk(mask, matcher.consume_token, matcher.is_stopped, matcher.reset, scores, steps))
    return prepare, results


def bench_xgrammar(tok, vocab, scores, steps):
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    prepare = time.perf_counter() - started
    results = {}
    for name, build in (("regex", lambda: compiler.compile_regex(REGEX)),
                        ("json", lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))):
        started = time.perf_counter()
        matcher = xgr.GrammarMatcher(build())
        compile_s = time.perf_counter() - started
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def mask():
            matcher.fill_next_token_bitmask(bitmask)
            return unpack(bitmask[0], vocab)

        results[name] = (compile_s, *walk(mask, matcher.accept_token, matcher.is_terminated, matcher.reset, scores, steps))
    return prepare, results


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: byte -> the character that spells it in the vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def bench_outlines_core(tok, vocab, scores, steps):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    started = time.perf_counter()
    byte_of = {c: b for b, c in byte_level_alphabet().items()}
    tokens: dict[bytes, list[int]] = {}
    for text, token in tok.get_vocab().items():
        if token == tok.eos_token_id or token in tok.all_special_ids:
            continue
        tokens.setdefault(bytes(byte_of[c] for c in text), []).append(token)
    vocabulary = Vocabulary(tok.eos_token_id, tokens)
    prepare = time.perf_counter() - started
    results = {}
    for name, regex in (("regex", REGEX), ("json", build_regex_from_schema(json.dumps(SCHEMA)))):
        started = time.perf_counter()
        guide = Guide(Index(regex, vocabulary))
        compile_s = time.perf_counter() - started
        bitmask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

        def mask():
            guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())
            return unpack(bitmask, vocab)

        def consume(token):
            guide.advance(token)

        def done():
            return guide.is_finished() or guide.get_tokens() == [tok.eos_token_id]

        results[name] = (compile_s, *walk(mask, consume, done, guide.reset, scores, steps))
    return prepare, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    vocab = len(tok)
    scores = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    benches = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines_core}
    print(f"vocabulary {vocab}, {args.steps} steps per constraint, one thread")
    print("| engine | tokenizer prep s | constraint | compile ms | mask mean us | mask median us | consume mean us |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for engine in args.engines.split(","):
        prepare, results = benches[engine](tok, vocab, scores, args.steps)
        for name, (compile_s, masks, consumes) in results.items():
            print(
                f"| {engine} | {prepare:.2f} | {name} | {compile_s * 1e3:.1f} | {statistics.mean(masks) * 1e6:.0f} | "
                f"{statistics.median(masks) * 1e6:.0f} | {statistics.mean(consumes) * 1e6:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
