"""mdcli's own forward (mdcli.backends.llama) computes what transformers' forward computes.

The engine takes it for the Llama family (Llama, Qwen2, Mistral) under sdpa; every other model
keeps transformers' forward. Evidence: the same forest decoded by two engines, one on each forward,
gives logits within float32 tolerance at every step (with forks, a chunked prefill, a window and a
compaction), greedy tokens equal to `model.generate` for every branch, on tiny random models and
on the real embedded model; its fused weights are views of the model's own memory.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mdcli.backends.attention.gemm import onednn_linear_works
from mdcli.backends import forward as forward_module
from mdcli.backends.forward import CAUSAL_PIECE, causal_mask, forward_for, piece_size
from mdcli.backends.forward_support import unsupported_reason
from mdcli.backends.llama import FastForward
from mdcli.backends.select import (
    BMM_MAX_QUERIES,
    BMM_MAX_QUERIES_AVX512,
    SMALL_BLAS_QUERIES,
    SMALL_BLAS_QUERIES_AVX2,
    Host,
    select,
)
from mdcli.backends.weights.blas import (
    one_blas_thread,
    openblas_library,
    openblas_works,
)
from mdcli.backends.weights.packed import pack, packed_linear, pair_padded_linear
from mdcli.core.cache import new_cache
from mdcli.core.decoding import prefill_prompts
from mdcli.core.forest import pad_rows
from tests.reference import generate_alone
from tests.test_engine_exactness import (
    engine_for,
    greedy_forest,
    random_prompts,
    settings_with,
    tiny_model,
)

SUPPORTED = ["llama", "qwen2", "qwen3", "mistral"]
# only OpenBLAS's presence decides the skip: a kernel that disagreed with torch must fail these tests
needs_openblas = pytest.mark.skipif(openblas_library() is None, reason="numpy's BLAS is not OpenBLAS")
VARIANTS = [("bmm", False), ("sdpa", False), ("bmm", True)]  # attention, packed weights (None: as chosen)


# every width's attention on the bmm core, none on mdcli's attention kernel
BMM_ONLY = {"attention": "bmm", "bmm_max_queries": None, "fused_attention": False}


def own_variant(engine, **changes) -> FastForward:
    """Replace the engine's own forward by one built on its plan with `changes` (Plan fields, through
    dataclasses.replace), as benchmarks compare the variants; returns it."""
    model_forward = engine.model_forward
    model_forward.own = FastForward(model_forward.model, replace(model_forward.plan, **changes), windowed=model_forward.windowed)
    return engine.model_forward.own


def lockstep_logits(model, prompts, steps, *, drop_at=None, max_forward_tokens=1024, settings=None, **changes):
    """Decode the same forest on transformers' forward and on mdcli's, greedy on the former's
    tokens; return the worst logit difference and the tokens. mdcli's forward runs its plan with
    `changes` (Plan fields): by default every width on the bmm core (BMM_ONLY) and no tiled copy, so
    each test exercises the copies it names; the .gguf's blocks (mdcli.backends.weights.gguf_blocks)
    as chosen unless `blocks=None`. Both engines' plans are chosen under `settings` (default: the
    environment's)."""
    hf = engine_for(model, settings=settings, own_forward=False, max_forward_tokens=max_forward_tokens)
    own = engine_for(model, settings=settings, max_forward_tokens=max_forward_tokens)
    assert hf.model_forward.own is None and own.model_forward.own is not None
    own_variant(own, **{**BMM_ONLY, "tiled": False, **changes})
    outs = [prefill_prompts(e, prompts) for e in (hf, own)]
    rows = [[o.row for o in out] for out in outs]
    logits = [torch.stack([o.logits for o in out]) for out in outs]
    alive, worst = list(range(len(prompts))), 0.0
    generated = [[] for _ in prompts]
    for step in range(steps):
        worst = max(worst, float((logits[0] - logits[1]).abs().max()))
        tokens = logits[0].argmax(-1).tolist()
        assert logits[1].argmax(-1).tolist() == tokens, f"step {step}"
        for i, t in zip(alive, tokens):
            generated[i].append(t)
        if drop_at is not None and step == drop_at:  # branch 1 finishes: both caches compact
            keep = [j for j, i in enumerate(alive) if i != 1]
            alive, tokens = [alive[j] for j in keep], [tokens[j] for j in keep]
            for e, engine in enumerate((hf, own)):
                held = torch.stack([pad_rows(rows[e][j][None], len(engine))[0] for j in keep])
                rows[e] = list(engine.compact(held))
        for e, engine in enumerate((hf, own)):
            stacked = torch.stack([pad_rows(r[None], len(engine))[0] for r in rows[e]])
            out = engine.forward(stacked, [[t] for t in tokens])
            rows[e], logits[e] = [o.row for o in out], torch.stack([o.logits for o in out])
    return worst, generated


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-{'packed' if v[1] else 'plain'}")
@pytest.mark.parametrize("arch", SUPPORTED)
def test_own_forward_gives_transformers_logits_through_forks_chunks_and_compaction(arch, variant):
    if variant[1] and not onednn_linear_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    model = tiny_model(arch, "sdpa")
    prompts = random_prompts(37, [3, 9, 1, 5])
    worst, _ = lockstep_logits(model, prompts, steps=10, drop_at=4, attention=variant[0], packed=variant[1], max_forward_tokens=16)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"


@pytest.mark.parametrize("arch", SUPPORTED)
def test_engine_on_own_forward_gives_generate_tokens_for_every_branch(arch):
    model = tiny_model(arch, "sdpa")
    engine = engine_for(model)
    assert engine.model_forward.own is not None and engine.model_forward.plan.own_forward
    prompts = random_prompts(50, [4, 4, 12, 2, 7], seed=3)
    generated = greedy_forest(engine, prompts, steps=12, drop_at=3)
    for i, prompt in enumerate(prompts):
        assert generated[i] == generate_alone(model, prompt, len(generated[i])), f"branch {i}"


def test_a_lone_branch_uses_own_forward_without_a_mask_and_stays_exact():
    model = tiny_model("llama", "sdpa")
    prompt = random_prompts(40, [5])
    worst, generated = lockstep_logits(model, prompt, steps=8)
    assert worst < 1e-4
    assert generated[0] == generate_alone(model, prompt[0], 8)


@pytest.mark.parametrize("arch,attn", [("gpt2", "sdpa"), ("gemma3", "sdpa"), ("llama", "eager")])
def test_other_models_keep_transformers_forward(arch, attn):
    model = tiny_model(arch, attn)
    reason = unsupported_reason(model)
    assert reason
    plan = select(model)
    assert not plan.own_forward and plan.own_forward_reason == reason
    assert forward_for(model).own is None
    assert engine_for(model).model_forward.own is None


def test_the_opt_out_keeps_transformers_forward():
    model = tiny_model("llama", "sdpa")
    settings = settings_with(forward="transformers")
    plan = select(model, settings)
    assert not plan.own_forward and plan.own_forward_reason == "MDCLI_FORWARD=transformers"
    assert engine_for(model, settings=settings).model_forward.own is None
    assert engine_for(model, settings=settings_with(forward="auto")).model_forward.own is not None


def test_fused_projections_are_views_of_one_buffer_made_once():
    model = tiny_model("qwen2", "sdpa")  # biased q/k/v
    before = sum(p.numel() for p in model.parameters())
    plan = select(model)
    first = FastForward(model, replace(plan, packed=False)).layers[0]
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert linear.weight.untyped_storage().data_ptr() == first.qkv.untyped_storage().data_ptr()
        assert linear.bias.untyped_storage().data_ptr() == first.qkv_bias.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == first.gate_up.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    again = FastForward(model, replace(plan, packed=False)).layers[0]
    assert again.qkv.data_ptr() == first.qkv.data_ptr()  # a second engine reuses the fused buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_forwards_norm_is_transformers_rms_norm_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from mdcli.backends.llama import _rms_norm

    generator = torch.Generator().manual_seed(0)
    for hidden, rows, scale in [(576, 1, 1.0), (2048, 3, 1e-3), (64, 17, 1e3), (960, 256, 30.0)]:
        norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(hidden, generator=generator))
        x = (torch.randn(1, rows, hidden, generator=generator) * scale).to(dtype)
        assert torch.equal(_rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


def test_real_model_own_forward_matches_transformers_and_generate(embedded_float32):
    """The embedded_float32 SmolLM2 (Llama): three questions over a shared document, one finishing early."""
    tokenizer = embedded_float32.tokenizer
    document = "The lighthouse keeper Mara climbed the hundred steps every evening. " * 12
    questions = ("Who is Mara?", "How many steps are there?", "When does she climb?")
    prompts = [tokenizer(f"{document}\nQuestion: {q}\nAnswer:")["input_ids"] for q in questions]
    worst, generated = lockstep_logits(embedded_float32.model, prompts, steps=8, drop_at=3)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    for i in (0, 2):
        expected = generate_alone(embedded_float32.model, prompts[i], len(generated[i]))  # stops at EOS, if any
        assert len(expected) >= 4 and generated[i][: len(expected)] == expected, f"branch {i}"


@needs_openblas
def test_real_model_lone_branch_on_openblas_matches_transformers_and_generate(embedded_float32):
    """The embedded_float32 SmolLM2, one branch: every step's products on OpenBLAS (what one thread on an
    AVX-512 host runs), logits within float32 rounding, greedy tokens those of generate."""
    document = "The lighthouse keeper Mara climbed the hundred steps every evening. " * 12
    prompt = embedded_float32.tokenizer(f"{document}\nQuestion: Who is Mara?\nAnswer:")["input_ids"]
    worst, generated = lockstep_logits(embedded_float32.model, [prompt], steps=8, transposed=True, lone_blas=True,
                                       blocks=None)  # the float32 copies, not the .gguf's blocks
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    expected = generate_alone(embedded_float32.model, prompt, len(generated[0]))
    assert len(expected) >= 4 and generated[0][: len(expected)] == expected


def test_packed_weights_are_made_once_per_model():
    if not onednn_linear_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    model = tiny_model("llama", "sdpa")
    plan = select(model)
    first, second = FastForward(model, replace(plan, packed=True)), FastForward(model, replace(plan, packed=True))
    assert first.layers[0].qkv is second.layers[0].qkv
    assert model.model.layers[0].self_attn.q_proj.weight.layout == torch.strided  # the model keeps its own


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("arch", SUPPORTED)
def test_transposed_weights_for_lone_tokens_give_transformers_logits_and_generate_tokens(arch, packed):
    """The lone-token step on transposed weight copies (AVX2 hosts), wider steps on the others."""
    if packed and not onednn_linear_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    model = tiny_model(arch, "sdpa")
    prompts = random_prompts(41, [6, 2, 8], seed=5)
    worst, _ = lockstep_logits(model, prompts, steps=8, drop_at=3, packed=packed, transposed=True,
                               max_forward_tokens=16)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    alone = random_prompts(40, [5], seed=7)
    worst, generated = lockstep_logits(model, alone, steps=8, packed=packed, transposed=True)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    assert generated[0] == generate_alone(model, alone[0], 8)


@needs_openblas
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("arch", SUPPORTED)
def test_lone_tokens_on_openblas_give_transformers_logits_and_generate_tokens(arch, packed):
    """A lone token's products (and its attention's weighted sum) on OpenBLAS over the transposed
    copies, wider steps on the others: logits within float32 rounding, the tokens of generate."""
    if packed and not onednn_linear_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    model = tiny_model(arch, "sdpa")
    prompts = random_prompts(41, [6, 2, 8], seed=5)
    worst, _ = lockstep_logits(model, prompts, steps=8, drop_at=3, packed=packed, transposed=True,
                               lone_blas=True, max_forward_tokens=16)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    alone = random_prompts(40, [5], seed=7)
    worst, generated = lockstep_logits(model, alone, steps=8, packed=packed, transposed=True, lone_blas=True)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    assert generated[0] == generate_alone(model, alone[0], 8)


@pytest.mark.parametrize("arch", SUPPORTED)
def test_two_token_forwards_multiplied_as_four_rows_give_transformers_logits_and_generate_tokens(arch):
    """Two branches step as two-token forwards, which the packed weights multiply padded to four
    rows (AVX-512 hosts): logits within float32 rounding, each branch's tokens those of generate."""
    if not onednn_linear_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    model = tiny_model(arch, "sdpa")
    prompts = random_prompts(43, [4, 7], seed=11)
    worst, generated = lockstep_logits(model, prompts, steps=8, packed=True, pair_padding=True)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    for prompt, tokens in zip(prompts, generated):
        assert tokens == generate_alone(model, prompt, 8)


def test_pair_padding_changes_only_two_row_products_and_keeps_their_values():
    if not onednn_linear_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    weight, bias = torch.randn(96, 64), torch.randn(96)
    packed = pack(weight)
    for rows in (1, 2, 3, 5):
        x = torch.randn(1, rows, 64)
        padded = pair_padded_linear(x, packed, bias)
        assert padded.shape == (1, rows, 96)
        torch.testing.assert_close(padded, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        if rows != 2:
            assert torch.equal(padded, packed_linear(x, packed, bias))


@needs_openblas
@pytest.mark.parametrize("arch", SUPPORTED)
def test_a_lone_token_that_sees_part_of_the_cache_on_openblas_gets_its_own_logits(arch):
    """One branch of two steps alone (the other waits): its single query reads the cache through a
    mask, on OpenBLAS, and gets the logits transformers' forward gives it."""
    model = tiny_model(arch, "sdpa")
    hf = engine_for(model, own_forward=False)
    own = engine_for(model)
    own_variant(own, **BMM_ONLY, packed=False, transposed=True, lone_blas=True)
    prompts = random_prompts(9, [7, 11], seed=2)
    logits = []
    for engine in (hf, own):
        first = prefill_prompts(engine, prompts)[0]
        out = engine.forward(pad_rows(first.row[None], len(engine)), [[int(first.logits.argmax())]])
        logits.append(out[0].logits)
    assert float((logits[0] - logits[1]).abs().max()) < 1e-4


@pytest.mark.parametrize("arch", SUPPORTED)
def test_on_one_thread_the_hosts_own_choices_give_generate_tokens_for_every_branch(arch, torch_threads):
    """torch on one thread, the forward as the host chooses it (on AVX-512: OpenBLAS for the lone
    token left after the other branch is dropped and compacted away): every branch's greedy tokens
    are generate's alone."""
    torch_threads(1)
    model = tiny_model(arch, "sdpa")
    engine = engine_for(model)
    prompts = random_prompts(30, [5, 9], seed=4)
    generated = greedy_forest(engine, prompts, steps=10, drop_at=2)
    for i, prompt in enumerate(prompts):
        assert generated[i] == generate_alone(model, prompt, len(generated[i])), f"branch {i}"


@needs_openblas
def test_the_embedded_model_on_one_thread_speculates_to_the_same_answers(embedded, torch_threads):
    """One thread (OpenBLAS for lone tokens on AVX-512), several questions whose answers end at
    different lengths, speculation forced on: the answers are those without speculation and those
    of generate alone."""
    from mdcli.api import ask_many
    from tests.test_speculate import (
        QUOTING,
        STORY,
        assert_branches_equal_generate,
        finishes,
    )

    torch_threads(1)
    runs = {s: list(ask_many(embedded, STORY, QUOTING, max_new_tokens=24, speculate=s)) for s in ("off", "16")}
    assert finishes(runs["16"]) == finishes(runs["off"])
    assert_branches_equal_generate(embedded.model, runs["off"])


def test_without_numpys_openblas_a_lone_token_keeps_torchs_kernels(monkeypatch, torch_threads):
    """numpy built on another BLAS (or threadpoolctl missing): no OpenBLAS path and, on an AVX-512
    host, no transposed copy for it; the step is what it was before. The host's own probe is read
    (monkeypatched here), and a host that states it alike is planned the same."""
    from mdcli.backends.weights import blas as blas_gemv

    monkeypatch.setattr(blas_gemv, "openblas_library", lambda: None)
    torch_threads(1)
    assert not blas_gemv.openblas_works()
    model = tiny_model("llama", "sdpa")
    for host in (Host.read(), kind("AVX512", "AMD", 1, openblas=False)):
        plan = select(model, settings_with(), host)
        assert "OpenBLAS" not in plan.describe() and not plan.lone_blas
        chosen = FastForward(model, plan)
        assert not chosen.lone_blas and chosen.blas_queries == 0
        if plan.linears.name == "oneDNN":
            assert not plan.transposed and not chosen.transposed


@needs_openblas
def test_numpys_openblas_passes_the_agreement_check_the_step_choice_relies_on():
    assert openblas_works()


@needs_openblas
def test_openblas_runs_on_one_thread_inside_a_forward_and_gets_its_setting_back():
    blas = openblas_library()
    before = blas.get_num_threads()
    blas.set_num_threads(2)
    try:
        with one_blas_thread():
            assert blas.get_num_threads() == 1
        assert blas.get_num_threads() == 2
    finally:
        blas.set_num_threads(before)


def test_transposed_copies_are_made_once_and_leave_the_models_weights_alone():
    model = tiny_model("qwen2", "sdpa")
    plan = select(model)
    first, second = (FastForward(model, replace(plan, packed=False, transposed=True)) for _ in range(2))
    assert first.lone[0].qkv is second.lone[0].qkv and first.lone_head is second.lone_head
    assert torch.equal(first.lone[0].qkv, first.layers[0].qkv.t())
    assert first.layers[0].qkv.data_ptr() == model.model.layers[0].self_attn.q_proj.weight.data_ptr()


@pytest.fixture
def torch_threads():
    """Set torch's thread count inside a test; the count it had is restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def kind(capability: str, vendor: str, threads: int, *, machine: str = "x86_64", onednn: bool = True,
         openblas: bool = True, tiled: bool = True, free: int = 2**40) -> Host:
    """A host of a kind the rules name: its ISA, vendor and torch threads, and what its probes find
    (oneDNN's linear, numpy's OpenBLAS, mdcli's tiled kernel, the free memory); no .gguf block kernel."""
    return Host(machine, capability, vendor, threads, onednn=lambda: onednn, openblas=lambda: openblas,
                tiled_kernel=lambda: tiled, block_kernel=lambda: False, free_memory=lambda device: free)


OPENBLAS_NOTE = "one thread: a lone token on OpenBLAS"
TILED_NOTE = "tokens on mdcli's tiled kernel"
# (host, settings changed, expected): linears, packed, transposed, lone_blas, attention,
# bmm_max_queries, read_ahead, pair_padded, tiled, the forward's blas_queries, notes in the description
# (None: not stated; the notes name the host's rule, made before the copies are counted)
STOCK = ("torch", False, False, False, "sdpa", None, False, False, False, 0, set())
HOST_KINDS = {
    # AVX2-only x86-64 (measured on Zen 3): packed and transposed copies (torch's kernels for a lone
    # token on more threads), bmm attention up to 64 queries, padding measured slower there
    "avx2-amd": (kind("AVX2", "AMD", 2), {},
                 ("torch", True, True, False, "bmm", BMM_MAX_QUERIES, True, False, False, 0, set())),
    "avx2-intel": (kind("AVX2", "Intel", 2), {},  # reading ahead only on AMD cores
                   ("torch", True, True, False, "bmm", BMM_MAX_QUERIES, False, False, False, 0, set())),
    # on one thread: a lone token on OpenBLAS, its weighted sum too, and 2-64 tokens on the tiled copy
    "avx2-amd-1": (kind("AVX2", "AMD", 1), {},
                   ("torch", True, True, True, "bmm", BMM_MAX_QUERIES, True, False, True, SMALL_BLAS_QUERIES_AVX2,
                    {OPENBLAS_NOTE, TILED_NOTE})),
    "avx2-amd-1-no-openblas": (kind("AVX2", "AMD", 1, openblas=False), {},
                               ("torch", True, True, False, "bmm", BMM_MAX_QUERIES, True, False, True, 0,
                                {TILED_NOTE})),
    "avx2-amd-1-no-tiled-kernel": (kind("AVX2", "AMD", 1, tiled=False), {},
                                   ("torch", True, True, True, "bmm", BMM_MAX_QUERIES, True, False, False,
                                    SMALL_BLAS_QUERIES_AVX2, {OPENBLAS_NOTE})),
    # oneDNN hosts (AVX-512, measured on Zen 4): packed, bmm up to 32 queries; on AMD cores two-row
    # products padded to four and the cache read ahead (both slower on an Intel Xeon)
    "avx512-amd": (kind("AVX512", "AMD", 2), {},
                   ("oneDNN", True, False, False, "bmm", BMM_MAX_QUERIES_AVX512, True, True, False, 0, set())),
    "avx512-intel": (kind("AVX512", "Intel", 2), {},
                     ("oneDNN", True, False, False, "bmm", BMM_MAX_QUERIES_AVX512, False, False, False, 0, set())),
    # on one thread a transposed copy that a lone token multiplies on OpenBLAS, its weighted sum for
    # forwards of up to 3 tokens; mdcli's AVX2 kernel is measured only on AVX2-only hosts
    "avx512-amd-1": (kind("AVX512", "AMD", 1), {},
                     ("oneDNN", True, True, True, "bmm", BMM_MAX_QUERIES_AVX512, True, True, False,
                      SMALL_BLAS_QUERIES, {OPENBLAS_NOTE})),
    "avx512-amd-1-no-openblas": (kind("AVX512", "AMD", 1, openblas=False), {},
                                 ("oneDNN", True, False, False, "bmm", BMM_MAX_QUERIES_AVX512, True, True, False, 0,
                                  set())),
    # forced stock kernels: no copy, sdpa, no reading ahead, no mdcli kernel either
    "torch-on-avx2-1": (kind("AVX2", "AMD", 1), {"cpu_kernels": "torch"}, STOCK),
    "torch-on-avx512-1": (kind("AVX512", "AMD", 1), {"cpu_kernels": "torch"}, STOCK),
    "not-x86": (kind("DEFAULT", "", 1, machine="aarch64"), {}, STOCK),
    # no working oneDNN: torch's kernels and sdpa (reading ahead is planned, as before, but only the bmm core reads ahead)
    "no-onednn-avx2-1": (kind("AVX2", "AMD", 1, onednn=False), {},
                         ("torch", False, False, False, "sdpa", None, True, False, False, 0, set())),
    # forced oneDNN on an AVX2 host: the AVX-512 choices, none of the host-kind rules of auto
    "onednn-on-avx2": (kind("AVX2", "AMD", 2), {"cpu_kernels": "onednn"},
                       ("oneDNN", True, False, False, "bmm", BMM_MAX_QUERIES_AVX512, False, True, False, 0, set())),
    # copies turned off, or not fitting in half the free memory: none made
    "unpacked-avx2-1": (kind("AVX2", "AMD", 1), {"packed_weights": False},
                        ("torch", False, False, False, "bmm", BMM_MAX_QUERIES, True, False, False, 0, None)),
    "no-memory-avx512-1": (kind("AVX512", "AMD", 1, free=0), {},
                           ("oneDNN", False, False, False, "bmm", BMM_MAX_QUERIES_AVX512, True, False, False, 0,
                            None)),
    # MDCLI_TILED_GEMM: off never, always wherever the kernel runs
    "tiled-off-avx2-1": (kind("AVX2", "AMD", 1), {"tiled_gemm": "off"},
                         ("torch", True, True, True, "bmm", BMM_MAX_QUERIES, True, False, False,
                          SMALL_BLAS_QUERIES_AVX2, {OPENBLAS_NOTE})),
    "tiled-always-avx512": (kind("AVX512", "AMD", 2), {"tiled_gemm": "always"},
                            ("oneDNN", True, False, False, "bmm", BMM_MAX_QUERIES_AVX512, True, True, True, 0,
                             {TILED_NOTE})),
    "tiled-always-no-kernel": (kind("AVX512", "AMD", 2, tiled=False), {"tiled_gemm": "always"},
                               ("oneDNN", True, False, False, "bmm", BMM_MAX_QUERIES_AVX512, True, True, False, 0,
                                set())),
}


@pytest.mark.parametrize("name", list(HOST_KINDS))
def test_the_step_choices_follow_the_host_kind(name):
    """The plan for each host kind the rules were measured on (mdcli.backends.select), and the own
    forward built from it takes exactly those choices."""
    host, changes, expected = HOST_KINDS[name]
    (linears, packed, transposed, lone_blas, attention, bmm_max_queries, read_ahead, pair_padded, tiled,
     blas_queries, notes) = expected
    model = tiny_model("llama", "sdpa")
    plan = select(model, settings_with(**{"cpu_kernels": "auto", **changes}), host)  # auto's rules, whatever the environment forces
    assert plan.own_forward and plan.linears.name == linears and plan.linears.reason
    assert (plan.attention, plan.bmm_max_queries, plan.read_ahead) == (attention, bmm_max_queries, read_ahead)
    assert notes is None or {note for note in (OPENBLAS_NOTE, TILED_NOTE) if note in plan.describe()} == notes
    assert plan.describe().startswith(f"{plan.linears.name} ({plan.linears.reason}")
    if packed and not onednn_linear_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    chosen = FastForward(model, plan)
    got = (chosen.packed, chosen.transposed, chosen.lone_blas, chosen.attention, chosen.bmm_max_queries,
           chosen.read_ahead, chosen.pair_padded, chosen.tiled, chosen.blas_queries)
    assert got == (packed, transposed, lone_blas, attention, bmm_max_queries, read_ahead, pair_padded, tiled,
                   blas_queries)
    assert chosen.onednn == (linears == "oneDNN")


def test_forwards_on_the_blocks_take_the_block_kernel_up_to_64_tokens_only_on_one_avx2_thread():
    """The plan's block_kernel_rows: 64 on one AVX2 thread (the kernel beat the tiles' GEMM there
    up to 64 rows), a step's 16 on more threads, where the GEMM gets them all, and on AVX-512."""
    model = tiny_model("llama", "sdpa")
    rows = {(capability, threads): select(model, settings_with(), kind(capability, "AMD", threads)).block_kernel_rows
            for capability in ("AVX2", "AVX512") for threads in (1, 2)}
    assert rows == {("AVX2", 1): 64, ("AVX2", 2): 16, ("AVX512", 1): 16, ("AVX512", 2): 16}


def test_this_hosts_engine_runs_the_plan_chosen_for_it(torch_threads):
    """On the machine running the tests, at one thread and two: the engine's own forward follows the
    plan `select` makes for this host."""
    model = tiny_model("llama", "sdpa")
    for threads in (1, 2):
        torch_threads(threads)
        plan = select(model)
        own = engine_for(model).model_forward.own
        assert (own.packed, own.transposed, own.lone_blas, own.attention, own.bmm_max_queries, own.read_ahead,
                own.tiled) == (plan.packed, plan.transposed and not plan.blocks, plan.lone_blas and plan.transposed,
                               plan.attention, plan.bmm_max_queries, plan.read_ahead, plan.tiled)


@pytest.mark.parametrize("arch", SUPPORTED)
def test_forwards_past_the_bmm_query_limit_attend_with_sdpa_and_agree(arch):
    """A forward of more queries than bmm_max_queries runs sdpa, one of fewer bmm, in the same
    forward object: the logits of a long prefill and of the steps after it are transformers'."""
    model = tiny_model(arch, "sdpa")
    hf = engine_for(model, own_forward=False)
    own = engine_for(model)
    own_variant(own, **{**BMM_ONLY, "bmm_max_queries": 4}, packed=False, transposed=False)
    # the prompts' prefill (> 4 queries) goes to sdpa, the steps to bmm
    prompts = random_prompts(11, [9, 7, 12])
    for engine in (hf, own):
        engine.outs = prefill_prompts(engine, prompts)
    prefill = torch.stack([o.logits for o in own.outs]) - torch.stack([o.logits for o in hf.outs])
    assert float(prefill.abs().max()) < 1e-4
    tokens = [[int(o.logits.argmax())] for o in hf.outs]
    steps = []
    for engine in (hf, own):
        rows = torch.stack([pad_rows(o.row[None], len(engine))[0] for o in engine.outs])
        steps.append(torch.stack([o.logits for o in engine.forward(rows, tokens)]))
    assert float((steps[0] - steps[1]).abs().max()) < 1e-4


def test_the_last_layer_multiplies_only_the_rows_whose_logits_are_kept():
    """Past the last layer's attention nothing reads a row whose logits are not kept: its output
    projection and MLP take the kept rows only, and a forward that keeps none stops at the last
    layer's keys and values. The kept rows' logits and the cache are a whole forward's."""
    model = tiny_model("llama", "sdpa")
    own = engine_for(model).model_forward.own
    layers = len(model.model.layers)
    rows_multiplied = []

    def recorded(linear):
        def product(x, weight, bias=None):
            rows_multiplied.append(x.reshape(-1, x.shape[-1]).shape[0])
            return linear(x, weight, bias)
        return product

    own.formats = tuple(replace(f, linear=recorded(f.linear)) for f in own.formats)
    tokens = torch.tensor(random_prompts(4, [5], seed=5)[0])  # 9 tokens
    positions, mask = torch.arange(9), causal_mask(9, 0, torch.float32)
    caches = {keep: new_cache() for keep in ("every", "two", "none")}
    with torch.inference_mode():
        every = own(tokens, positions, mask, caches["every"], torch.arange(9))
        multiplied_every, rows_multiplied[:] = list(rows_multiplied), []
        two = own(tokens, positions, mask, caches["two"], torch.tensor([6, 2]))
        multiplied_two, rows_multiplied[:] = list(rows_multiplied), []
        assert own(tokens, positions, mask, caches["none"], None) is None
    per_layer = 4  # q/k/v, o, gate/up, down
    assert multiplied_every == [9] * (per_layer * layers) + [9]  # and the head
    assert multiplied_two == [9] * (per_layer * (layers - 1) + 1) + [2] * 3 + [2]
    assert rows_multiplied == [9] * (per_layer * (layers - 1) + 1)  # the last layer's q/k/v, nothing after
    assert torch.allclose(two, every[[6, 2]], atol=1e-5, rtol=1e-5)
    for index in range(layers):
        for keep in ("two", "none"):
            held, whole = caches[keep].layers[index], caches["every"].layers[index]
            assert torch.equal(held.keys, whole.keys) and torch.equal(held.values, whole.values)


@pytest.mark.parametrize("tokens, size", [(567, 284), (512, 512), (513, 257), (1819, 455), (40, 40), (1, 1)])
def test_a_causal_continuation_takes_as_few_pieces_as_full_ones_would_but_of_equal_size(tokens, size):
    """No short last piece: its products would rebuild every weight for a few rows."""
    assert CAUSAL_PIECE == 512
    assert piece_size(tokens) == size
    assert -(-tokens // size) == -(-tokens // CAUSAL_PIECE)


def test_a_prompt_on_the_blocks_in_causal_pieces_gives_one_forwards_logits_and_cache(embedded, monkeypatch):
    """The embedded model holds no float32 projections, so a continuation without a mask runs on the
    own forward piece by piece (16 tokens a piece here: 40 tokens as 14 + 14 + 12); the kept rows'
    logits, wherever their piece, and the cache are those of one causal forward of all 40."""
    monkeypatch.setattr(forward_module, "CAUSAL_PIECE", 16)
    model_forward = embedded.forward
    assert model_forward.plan.on_blocks
    own, pieces = model_forward.own, []

    def recorded(tokens, *rest):
        pieces.append(len(tokens))
        return own(tokens, *rest)

    tokens = torch.tensor(embedded.tokenizer("The pieces of a long prompt. " * 8)["input_ids"][:40])
    keep, caches = torch.tensor([5, 20, 39]), (new_cache(), new_cache())
    with torch.inference_mode():
        whole = own(tokens, torch.arange(40), causal_mask(40, 0, torch.float32), caches[0], keep)
        monkeypatch.setattr(model_forward, "own", recorded)
        pieced = model_forward(tokens, torch.arange(40), None, caches[1], keep)
    assert pieces == [14, 14, 12]
    assert float((pieced - whole).abs().max()) < 1e-4 and torch.equal(pieced.argmax(-1), whole.argmax(-1))
    for layer in range(len(caches[0].layers)):
        assert float((caches[0].layers[layer].keys - caches[1].layers[layer].keys).abs().max()) < 1e-4, layer
