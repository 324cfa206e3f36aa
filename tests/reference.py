"""The reference every exactness test compares with: a branch's prompt run alone through the
plain model, greedy, with Hugging Face's own `generate`."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from mdcli.backends.weights import gguf_blocks

_PLAIN: dict[str, torch.nn.Module] = {}


def plain(model):
    """The model `generate` runs on: `model` itself, or, where mdcli left its projections in the
    .gguf's blocks (mdcli.models.on_blocks: no float32 weights to run), transformers' own float32
    load of that same .gguf, loaded once: the model a user of transformers would have."""
    if not gguf_blocks.on_blocks_only(model):
        return model
    path = gguf_blocks.source_of(model)
    if str(path) not in _PLAIN:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        _PLAIN[str(path)] = loaded.eval().requires_grad_(False)
    return _PLAIN[str(path)]


def generate_alone(model, prompt_ids: list[int], new_tokens: int, *, device=None) -> list[int]:
    model = plain(model)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids], device=device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
            do_sample=False,
            max_new_tokens=new_tokens,
        )
    return out[0, len(prompt_ids) :].tolist()


class ConstrainedAlone(LogitsProcessor):
    """generate's logits processor for a branch under an output constraint: the tokens generated
    so far advance one llguidance matcher (mdcli.constraints, the same library and grammar the
    forest uses), and every token it does not allow scores -inf."""

    def __init__(self, constraint, tokenizer, prompt_length: int) -> None:
        from mdcli.constraints import compile_for  # lazy: the reference helpers above need only torch

        self.state = compile_for(constraint, tokenizer).start()
        self.prompt_length = prompt_length
        self.seen = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_length :].tolist()
        for token in generated[self.seen :]:
            self.state.advance(token)
        self.seen = len(generated)
        allowed = torch.empty(scores.shape[-1], dtype=torch.bool)
        self.state.allowed(allowed)
        return scores.masked_fill(~allowed.to(scores.device)[None], float("-inf"))


def generate_constrained(model, tokenizer, prompt_ids: list[int], constraint, new_tokens: int, *, device=None) -> list[int]:
    """generate_alone under `constraint` (an mdcli Constraint; None: none). A branch whose answer
    is complete ends without EOS; generate, whose mask then allows only EOS, adds it next."""
    processors = LogitsProcessorList([ConstrainedAlone(constraint, tokenizer, len(prompt_ids))] if constraint else [])
    model = plain(model)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids], device=device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
            do_sample=False, max_new_tokens=new_tokens, logits_processor=processors,
        )
    return out[0, len(prompt_ids) :].tolist()


def branches_off_their_runs_alone(lm, document: str, questions: list[str], new_tokens: int, max_gap) -> list[str]:
    """Ask every question of the document in one forest, then run each branch alone with
    `generate`; describe every branch whose first differing token is no near-tie. max_gap(logits)
    is how far below the reference's chosen token the forest's may score in the reference's own
    logits at that token (logits: [V] float32). An empty list: every branch agrees up to ties."""
    from mdcli.api import ask_many  # lazy: the reference helpers above need only torch
    from mdcli.events import Finish, Start  # lazy: as above

    starts, finishes = {}, {}
    for event in ask_many(lm, document, questions, max_new_tokens=new_tokens):
        if isinstance(event, Start):
            starts = {b.id: b.prompt_token_ids for b in event.branches}
        elif isinstance(event, Finish):
            finishes[event.branch] = event.token_ids
    assert len(finishes) == len(questions)
    problems = []
    for branch, ours in finishes.items():
        prompt = starts[branch]
        theirs = generate_alone(lm.model, prompt, new_tokens, device=lm.device)[: len(ours)]
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None:
            if len(ours) != len(theirs):
                problems.append(f"branch {branch}: {len(ours)} tokens, alone {len(theirs)}")
            continue
        with torch.inference_mode():
            sequence = torch.tensor([prompt + theirs[:first]], device=lm.device)
            logits = plain(lm.model)(sequence).logits[0, -1].float()  # [V]
        gap = float(logits[theirs[first]] - logits[ours[first]])
        if gap > max_gap(logits):
            problems.append(f"branch {branch}: token {first} differs with a logit gap of {gap:.3f}")
    return problems
