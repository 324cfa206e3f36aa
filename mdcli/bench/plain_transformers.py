"""Many questions about one document with plain Hugging Face transformers, as a user would script it.

This file is run as a script (``python plain_transformers.py ...``), never imported by mdcli, so that
its process pays for torch and transformers only: it is the baseline of the whole-process benchmark
(mdcli.bench.whole_process). Three ways users write it:

  sequential     generate() once per question
  batched        one generate() over the left-padded prompts
  prefill-once   prefill the shared prompt prefix once, then per question a copy.deepcopy of that
                 cache and generate() (the reuse pattern transformers' documentation shows)

Greedy, `max_new_tokens` each, stopping at EOS like mdcli. Prints one JSON object on stdout: the
generated token ids per question (EOS included, as mdcli reports them) and the seconds per phase.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import time

started = time.perf_counter()

import torch  # noqa: E402  (timed: the import is part of what the user waits for)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

TEMPLATE = "{document}\n\nAnswer this question about the text above.\nQuestion: {question}"  # mdcli's ask-many


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("document")
    parser.add_argument("questions", help="a file with one question per line")
    parser.add_argument("--mode", choices=["sequential", "batched", "prefill-once"], required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    imported = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    loaded = time.perf_counter()

    document = open(args.document, encoding="utf-8").read()
    questions = [line.strip() for line in open(args.questions, encoding="utf-8") if line.strip()]
    prompts = [prompt_ids(tokenizer, TEMPLATE.format(document=document, question=q)) for q in questions]
    run = {"sequential": sequential, "batched": batched, "prefill-once": prefill_once}[args.mode]
    with torch.inference_mode():
        answers = run(model, tokenizer, prompts, args.max_new_tokens)
    done = time.perf_counter()
    print(json.dumps({
        "mode": args.mode,
        "token_ids": answers,
        "import_seconds": round(imported - started, 3),
        "load_seconds": round(loaded - imported, 3),
        "generate_seconds": round(done - loaded, 3),
    }))


def prompt_ids(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


def generate_kwargs(model, max_new_tokens: int) -> dict:
    return {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": model.generation_config.pad_token_id
            or model.generation_config.eos_token_id}


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """A generated row cut after its first EOS (batched rows go on padding after it)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def sequential(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    answers = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), **generate_kwargs(model, max_new_tokens))
        answers.append(until_eos(out[0, len(prompt):].tolist(), eos_ids(model)))
    return answers


def batched(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, **generate_kwargs(model, max_new_tokens))
    return [until_eos(row[width:].tolist(), eos_ids(model)) for row in out]


def prefill_once(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    prefix = DynamicCache()
    model(torch.tensor([prompts[0][:shared]]), **cache_argument(model, prefix), use_cache=True)
    answers = []
    for prompt in prompts:
        cache = copy.deepcopy(prefix)
        out = model.generate(torch.tensor([prompt]), **cache_argument(model, cache),
                             **generate_kwargs(model, max_new_tokens))
        answers.append(until_eos(out[0, len(prompt):].tolist(), eos_ids(model)))
    return answers


def cache_argument(model, cache) -> dict:
    """`cache=` where the installed transformers takes it (5.24 renamed `past_key_values`), else
    `past_key_values=` (what mdcli.backends.reference.cache_argument does; this script imports no mdcli)."""
    return {"cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values": cache}


if __name__ == "__main__":
    main()
