"""ask-many, side by side: the forest against what users would run instead.

All approaches get the same chat-templated prompts (one document, B questions) and generate
exactly N greedy tokens per question (EOS suppressed, as `min_new_tokens` does), so the work is
equal and the tokens must agree; every run checks that and reports any difference.

(a) forest       mdcli: one shared cache, one forward per step for all branches
(b) sequential   `model.generate` once per question (what most users write)
(c) batched      one `model.generate` over the left-padded prompts
(d) prefix-copy  prefill the document once, copy its KV per question into a preallocated batch
                 cache, feed the (padded) question suffixes, decode as a batch

On request (not by default):

(e) forest+speculate  the forest with speculative decoding (`--speculate auto`, prompt lookup drafts)
(f) hf-prompt-lookup  `model.generate(prompt_lookup_num_tokens=10)` once per question: Hugging
                      Face's prompt lookup decoding, the single-sequence version of (e)
(g) forest-no-blocks  the forest with no forward on the .gguf's blocks (MDCLI_GGUF_BLOCKS=0,
                      mdcli.backends.weights.gguf_blocks): the float32 kernels alone, the same weights, so the same
                      tokens are required
(h) forest-no-graphs  the forest with every forward launched as it comes, none replayed as a CUDA
                      graph (MDCLI_CUDA_GRAPHS=off, mdcli.backends.graphs): what the graphs gain on a
                      GPU, the same weights and kernels, so the same tokens are required (float32)
(i) forest-int8       the forest over an int8 copy of the model (`--cpu-weights int8`,
                      mdcli.backends.weights.int8), made once per model: a different, lossier model, so its
                      tokens are not compared with the forest's

(a) is the forest without speculation, so every ratio is against plain forest steps.
(b)-(d) and (f) run on torch's stock kernels, as users run them; `baseline_kernels="mdcli"` gives them
the CPU kernels mdcli's engine uses (mdcli.backends.kernels) to show what the algorithm alone gains.
"""

from __future__ import annotations

import copy
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from mdcli import settings
from mdcli.api import run_specs
from mdcli.backends.forward import ModelForward
from mdcli.backends.reference import cache_argument
from mdcli.backends.select import select
from mdcli.backends.weights.int8 import described, quantize_model
from mdcli.bench.harness import baseline_kernels as alternatives_context
from mdcli.bench.steppers import ReferenceStepper, median_step_seconds
from mdcli.bench.twin import float32_twin
from mdcli.core.cache import new_cache
from mdcli.core.decoding import BranchSpec, common_prefix_length
from mdcli.events import Done, Finish
from mdcli.models.memory import kv_bytes_per_token
from mdcli.strategies.ask_many import DEFAULT_TEMPLATE
from mdcli.strategies.prompts import fill_template, prompt_token_ids

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel

APPROACHES = ("forest", "sequential", "batched", "prefix-copy")  # the default set
SPECULATIVE_APPROACHES = ("forest+speculate", "hf-prompt-lookup")
KERNEL_APPROACHES = ("forest-no-blocks", "forest-no-graphs")  # the forest on other kernels of the same weights
OTHER_MODEL_APPROACHES = ("forest-int8",)  # another model's tokens: not compared with the forest's
ALL_APPROACHES = APPROACHES + SPECULATIVE_APPROACHES + KERNEL_APPROACHES + OTHER_MODEL_APPROACHES
ON_BLOCKS_APPROACHES = ("forest", "forest+speculate", "forest-no-graphs")  # run on the model as loaded; the rest on its float32 twin
HF_PROMPT_LOOKUP_TOKENS = 10

QUESTIONS = [
    "Who is the main character?",
    "Where does the story take place?",
    "What happens at the end?",
    "What is the weather like?",
    "Name one object in the story.",
    "What is the mood of the text?",
    "Who else appears in the text?",
    "Summarize the text in one sentence.",
]

_FILLER = (
    "Mara kept the lighthouse on the coast of Brittany for thirty years. Each evening she climbed the "
    "hundred steps, trimmed the wick and watched the fishing boats come home. In winter the storms "
    "came from the west and the fog lay on the water for days. The harbour master, an old friend "
    "named Yves, brought her bread and news from the village every Sunday. "
)


@dataclass
class Case:
    branches: int
    context_tokens: int
    new_tokens: int


@dataclass
class Measurement:
    approach: str
    case: Case
    seconds: float
    kv_bytes: int
    tokens: list[list[int]] = field(repr=False)
    repeat_seconds: list[float] = field(default_factory=list, repr=False)  # every repeat's seconds, in run order
    step_seconds: float | None = None  # decode time per step (forest only)
    step_bytes: int | None = None  # weights + KV a decode step reads, at the mean cache length (forest only)
    reference_step_seconds: float | None = None  # transformers' own 1-sequence step, same context (forest only)
    matches_forest: bool | None = None
    forwards: int | None = None  # decode forwards (speculative approaches)
    draft_tokens: int | None = None
    accepted_tokens: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.case.branches * self.case.new_tokens / self.seconds


def document_of(tokenizer, context_tokens: int) -> str:
    """A natural-looking document of about `context_tokens` tokens."""
    per_copy = len(tokenizer(_FILLER)["input_ids"])
    return _FILLER * max(1, round(context_tokens / per_copy))


def prompts_for(model: LoadedModel, case: Case) -> list[list[int]]:
    document = document_of(model.tokenizer, case.context_tokens)
    questions = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i})") for i in range(case.branches)]
    return [
        prompt_token_ids(model.tokenizer, fill_template(DEFAULT_TEMPLATE, "question", document=document, question=q))
        for q in questions
    ]


def run_case(model: LoadedModel, case: Case, approaches=APPROACHES, *, baseline_kernels: str = "stock",
             reverse: bool = False) -> list[Measurement]:
    """baseline_kernels: "stock" runs the alternatives as users run them (torch's own kernels);
    "mdcli" gives them mdcli's CPU kernels too, separating the algorithm's gain from the kernels'.
    reverse runs the approaches last to first (repeats alternate, so a machine that drifts over
    minutes favours no approach); the results come back in the order asked either way."""
    prompts = prompts_for(model, case)
    runners = {"forest": forest, "sequential": sequential, "batched": batched, "prefix-copy": prefix_copy,
               "forest+speculate": forest_speculating, "hf-prompt-lookup": hf_prompt_lookup,
               "forest-no-blocks": forest_without_blocks, "forest-no-graphs": forest_without_graphs,
               "forest-int8": forest_int8}
    measured = {}
    for name in reversed(approaches) if reverse else approaches:
        runs_on = model if name in ON_BLOCKS_APPROACHES else float32_twin(model)  # generate needs float32 weights
        with nullcontext() if name.startswith("forest") else alternatives_context(runs_on, baseline_kernels):
            measured[name] = runners[name](runs_on, prompts, case)
    results = [measured[name] for name in approaches]
    reference = next((r for r in results if r.approach == "forest"), None)
    for result in results:
        if reference is not None and result.approach not in OTHER_MODEL_APPROACHES:
            result.matches_forest = result.tokens == reference.tokens
    return results


# -- (a) the forest ------------------------------------------------------------------------------


def forest(model: LoadedModel, prompts: list[list[int]], case: Case, *, speculate: str = "off",
           reference: bool = True) -> Measurement:
    specs = [BranchSpec(label=str(i), prompt_ids=p, max_new_tokens=case.new_tokens, ignore_eos=True)
             for i, p in enumerate(prompts)]
    started = time.perf_counter()
    tokens: dict[int, list[int]] = {}
    stats = None
    kv = 0
    for event in run_specs(model, specs, strategy="bench", speculate=speculate):
        if isinstance(event, Finish):
            tokens[event.branch] = event.token_ids
        elif isinstance(event, Done):
            stats = event.stats
    seconds = time.perf_counter() - started
    kv = _kv_bytes_per_token(model) * stats.peak_cache_tokens
    mean_cache_tokens = (stats.prefill_tokens + stats.peak_cache_tokens) / 2  # the cache grows linearly while decoding
    step_bytes = step_weight_bytes(model) + round(_kv_bytes_per_token(model) * mean_cache_tokens)
    return Measurement("forest" if speculate == "off" else "forest+speculate", case, seconds, kv,
                       [tokens[i] for i in range(len(prompts))],
                       step_seconds=stats.decode_seconds / max(1, stats.steps), step_bytes=step_bytes,
                       forwards=stats.steps, draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
                       reference_step_seconds=reference_step(model, prompts[0], case.new_tokens)
                       if speculate == "off" and reference else None)


def reference_step(model: LoadedModel, prompt: list[int], steps: int) -> float:
    """Median seconds of transformers' own single-sequence decode step over `prompt` and as many
    steps as the forest took (stock kernels, stock cache: mdcli.bench.step), measured right after
    the forest, so both see the same machine."""
    return median_step_seconds({"reference": ReferenceStepper(float32_twin(model), prompt)}, steps)["reference"]


def forest_speculating(model: LoadedModel, prompts: list[list[int]], case: Case) -> Measurement:
    return forest(model, prompts, case, speculate="auto")


def forest_without_blocks(model: LoadedModel, prompts: list[list[int]], case: Case) -> Measurement:
    """The forest with every forward on the float32 kernels, none on the .gguf's blocks (the model's
    plan chosen again with gguf_blocks off; mdcli.backends.weights.gguf_blocks): what reading the
    blocks gains, same weights, so its tokens are compared with the forest's."""
    return _forest_on_a_plan_with(model, prompts, case, "forest-no-blocks", gguf_blocks=False)


def forest_without_graphs(model: LoadedModel, prompts: list[list[int]], case: Case) -> Measurement:
    """The forest with no forward replayed as a CUDA graph (the model's plan chosen again with
    cuda_graphs off; mdcli.backends.graphs): what the graphs gain, the same weights and kernels, so
    its tokens are compared with the forest's."""
    return _forest_on_a_plan_with(model, prompts, case, "forest-no-graphs", cuda_graphs="off")


def _forest_on_a_plan_with(model: LoadedModel, prompts: list[list[int]], case: Case, approach: str,
                           **changes) -> Measurement:
    """The forest (no reference step) over the model's plan chosen again with these settings changed."""
    plan = select(model.model, settings.current().changed(**changes))
    changed = replace(model, forward=ModelForward(model.model, plan, sliding_window=model.sliding_window))
    measured = forest(changed, prompts, case, reference=False)
    measured.approach = approach
    return measured


def forest_int8(model: LoadedModel, prompts: list[list[int]], case: Case) -> Measurement:
    """The forest without speculation over an int8 copy of the model (no reference step: its
    ratio is against the float32 forest's row)."""
    measured = forest(int8_copy(model), prompts, case, reference=False)
    measured.approach = "forest-int8"
    return measured


_INT8_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # float32 module -> its int8 copy, for every case


def int8_copy(model: LoadedModel) -> LoadedModel:
    """A copy of `model` with its projections made int8 (mdcli.backends.weights.int8), made once and kept
    while the float32 model lives."""
    if model.model not in _INT8_COPIES:
        weights = copy.deepcopy(model.model)  # its weight copies are kept beside it, so none come along
        reason = f"{model.dtype_reason}; {described(quantize_model(weights))}"
        forward = ModelForward(weights, select(weights), sliding_window=model.sliding_window)
        _INT8_COPIES[model.model] = replace(model, model=weights, forward=forward, cpu_weights="int8",
                                            dtype_reason=reason)
    return _INT8_COPIES[model.model]


def step_weight_bytes(model: LoadedModel) -> int:
    """Bytes of weights a decode step reads: the blocks and the norms where the model runs on its
    .gguf's blocks alone, else `weight_bytes`."""
    if model.forward.plan.on_blocks:
        return sum(model.forward.weight_bytes().values())
    return weight_bytes(model.model)


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every tensor once (tied embeddings are one matrix), but
    not an input embedding of its own, of which a step reads one row per token."""
    embedding = model.get_input_embeddings().weight.untyped_storage()
    head = getattr(model.get_output_embeddings(), "weight", None)  # None: an int8 head (mdcli.backends.weights.int8)
    tied = head is not None and head.untyped_storage().data_ptr() == embedding.data_ptr()
    storages = {}
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        if tied or storage.data_ptr() != embedding.data_ptr():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# -- (b) generate per question --------------------------------------------------------------------


def sequential(model: LoadedModel, prompts: list[list[int]], case: Case) -> Measurement:
    started = time.perf_counter()
    tokens, kv = [], 0
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        with torch.inference_mode():
            out = model.model.generate(ids, attention_mask=torch.ones_like(ids), **_greedy(model, case))
        tokens.append(out[0, len(prompt):].tolist())
        kv = max(kv, _kv_bytes_per_token(model) * (len(prompt) + case.new_tokens))
    return Measurement("sequential", case, time.perf_counter() - started, kv, tokens)


# -- (f) Hugging Face prompt lookup, one question at a time ------------------------------------


def hf_prompt_lookup(model: LoadedModel, prompts: list[list[int]], case: Case) -> Measurement:
    calls = [0]
    hook = model.model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    started = time.perf_counter()
    tokens, kv = [], 0
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            with torch.inference_mode():
                out = model.model.generate(ids, attention_mask=torch.ones_like(ids),
                                           prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS, **_greedy(model, case))
            tokens.append(out[0, len(prompt):].tolist())
            kv = max(kv, _kv_bytes_per_token(model) * (len(prompt) + case.new_tokens))
    finally:
        hook.remove()
    seconds = time.perf_counter() - started
    return Measurement("hf-prompt-lookup", case, seconds, kv, tokens, forwards=calls[0] - len(prompts))


# -- (c) batched generate --------------------------------------------------------------------------


def batched(model: LoadedModel, prompts: list[list[int]], case: Case) -> Measurement:
    width = max(len(p) for p in prompts)
    pad = _pad_id(model)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.model.generate(ids, attention_mask=mask, **_greedy(model, case))
    seconds = time.perf_counter() - started
    kv = _kv_bytes_per_token(model) * len(prompts) * (width + case.new_tokens)
    return Measurement("batched", case, seconds, kv, out[:, width:].tolist())


# -- (d) prefix copied per branch, preallocated --------------------------------------------------


def prefix_copy(model: LoadedModel, prompts: list[list[int]], case: Case) -> Measurement:
    """The best hand-made alternative: shared prefill, then a batch over per-branch KV copies."""
    shared = _common_prefix_length(prompts)
    suffixes = [p[shared:] for p in prompts]
    width = max(len(s) for s in suffixes)
    batch = len(prompts)
    lm, device = model.model, model.device
    eos = sorted(model.eos_token_ids)
    started = time.perf_counter()
    with torch.inference_mode():
        cache = new_cache()
        lm(input_ids=torch.tensor([prompts[0][:shared]], device=device), **cache_argument(lm, cache), use_cache=True,
           logits_to_keep=1)
        for layer in cache.layers:  # one copy of the document's keys/values per branch
            keys, values = layer.keys.expand(batch, -1, -1, -1), layer.values.expand(batch, -1, -1, -1)
            layer.keys, layer.values = keys.contiguous(), values.contiguous()
        pad = _pad_id(model)
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in suffixes], device=device)  # [B, S]
        real = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in suffixes], device=device)
        mask = torch.cat([torch.ones(batch, shared, dtype=torch.long, device=device), real], 1)  # [B, P + S]
        positions = (shared + real.cumsum(1) - 1).clamp(min=shared)  # [B, S]
        logits = lm(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_argument(lm, cache),
                    use_cache=True, logits_to_keep=1).logits[:, -1].float()  # [B, V]
        next_position = positions[:, -1:] + 1  # [B, 1]
        generated = []
        for step in range(case.new_tokens):
            if eos:
                logits[:, eos] = float("-inf")
            token = logits.argmax(-1, keepdim=True)  # [B, 1]
            generated.append(token)
            if step == case.new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long, device=device)], 1)
            logits = lm(input_ids=token, attention_mask=mask, position_ids=next_position, **cache_argument(lm, cache),
                        use_cache=True).logits[:, -1].float()
            next_position = next_position + 1
    seconds = time.perf_counter() - started
    kv = _kv_bytes_per_token(model) * batch * (shared + width + case.new_tokens)
    return Measurement("prefix-copy", case, seconds, kv, torch.cat(generated, 1).tolist())


# -- helpers -----------------------------------------------------------------------------------


def _greedy(model: LoadedModel, case: Case) -> dict:
    return dict(do_sample=False, max_new_tokens=case.new_tokens, min_new_tokens=case.new_tokens,
                pad_token_id=_pad_id(model), num_beams=1)


def _pad_id(model: LoadedModel) -> int:
    tok = model.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else min(model.eos_token_ids or {0})


def _kv_bytes_per_token(model: LoadedModel) -> int:
    return kv_bytes_per_token(model.model.config, model.dtype.itemsize)


def _common_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens all prompts share, leaving every prompt at least one token of its own."""
    shortest = min(len(p) for p in prompts) - 1
    return min([shortest, *(common_prefix_length(prompts[0], other) for other in prompts[1:])])
