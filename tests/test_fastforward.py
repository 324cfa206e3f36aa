"""mdcli's own forward (mdcli.backends.llama) computes what transformers' forward computes.

The engine takes it for the Llama family (Llama, Qwen2, Mistral) under sdpa; every other model
keeps transformers' forward. Evidence: the same forest decoded by two engines, one on each forward,
gives logits within float32 tolerance at every step (with forks, a chunked prefill, a window and a
compaction), greedy tokens equal to `model.generate` for every branch, on tiny random models and
on the real embedded model; its fused weights are views of the model's own memory.
"""

from __future__ import annotations

import pytest
import torch

from mdcli.backends.weights.blas import one_blas_thread, openblas_library, openblas_works
from mdcli.backends.host import cpu_vendor
from mdcli.core.decoding import prefill_prompts
from mdcli.backends.llama import (
    BMM_MAX_QUERIES,
    BMM_MAX_QUERIES_AVX512,
    SMALL_BLAS_QUERIES,
    SMALL_BLAS_QUERIES_AVX2,
    FastForward,
    fast_forward_for,
    unsupported_reason,
)
from mdcli.core.forest import pad_rows
from mdcli.backends.kernels import avx2_step, kernel_choice, kernel_name, onednn_works
from mdcli.backends.weights.packed import pack, packed_linear, pair_padded_linear
from mdcli.backends.weights.tiled import tiled_works
from tests.reference import generate_alone
from tests.test_engine_exactness import engine_for, greedy_forest, random_prompts, tiny_model

SUPPORTED = ["llama", "qwen2", "qwen3", "mistral"]
# only OpenBLAS's presence decides the skip: a kernel that disagreed with torch must fail these tests
needs_openblas = pytest.mark.skipif(openblas_library() is None, reason="numpy's BLAS is not OpenBLAS")
VARIANTS = [("bmm", False), ("transformers", False), ("bmm", True)]  # attention, packed weights (None: as chosen)


def lockstep_logits(model, prompts, steps, *, drop_at=None, variant=("bmm", None), max_forward_tokens=1024,
                    transposed=None, lone_blas=None, pair_padded=None, tiled=False, blocks=None):
    """Decode the same forest on transformers' forward and on mdcli's, greedy on the former's
    tokens; return the worst logit difference and the tokens. The tiled copy only where asked for,
    so each test exercises the copies it names; the .gguf's blocks (mdcli.backends.weights.gguf_blocks) as chosen
    unless `blocks` says."""
    hf = engine_for(model, own_forward=False, max_forward_tokens=max_forward_tokens)
    own = engine_for(model, max_forward_tokens=max_forward_tokens)
    attention, packed = variant
    own._fast = FastForward(model, attention=attention, packed=packed, transposed=transposed, lone_blas=lone_blas,
                            pair_padded=pair_padded, tiled=tiled, blocks=blocks)
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
    if variant[1] and not onednn_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    model = tiny_model(arch, "sdpa")
    prompts = random_prompts(37, [3, 9, 1, 5])
    worst, _ = lockstep_logits(model, prompts, steps=10, drop_at=4, variant=variant, max_forward_tokens=16)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"


@pytest.mark.parametrize("arch", SUPPORTED)
def test_engine_on_own_forward_gives_generate_tokens_for_every_branch(arch):
    model = tiny_model(arch, "sdpa")
    engine = engine_for(model)
    assert engine.own_forward
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
    assert unsupported_reason(model)
    assert fast_forward_for(model) is None
    assert not engine_for(model).own_forward


def test_the_opt_out_keeps_transformers_forward(monkeypatch):
    monkeypatch.setenv("MDCLI_FORWARD", "transformers")
    assert not engine_for(tiny_model("llama", "sdpa")).own_forward


def test_fused_projections_are_views_of_one_buffer_made_once():
    model = tiny_model("qwen2", "sdpa")  # biased q/k/v
    before = sum(p.numel() for p in model.parameters())
    first = FastForward(model, packed=False).layers[0]
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert linear.weight.untyped_storage().data_ptr() == first.qkv.untyped_storage().data_ptr()
        assert linear.bias.untyped_storage().data_ptr() == first.qkv_bias.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == first.gate_up.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    again = FastForward(model, packed=False).layers[0]
    assert again.qkv.data_ptr() == first.qkv.data_ptr()  # a second engine reuses the fused buffer


def test_real_model_own_forward_matches_transformers_and_generate(embedded):
    """The embedded SmolLM2 (Llama): three questions over a shared document, one finishing early."""
    tokenizer = embedded.tokenizer
    document = "The lighthouse keeper Mara climbed the hundred steps every evening. " * 12
    questions = ("Who is Mara?", "How many steps are there?", "When does she climb?")
    prompts = [tokenizer(f"{document}\nQuestion: {q}\nAnswer:")["input_ids"] for q in questions]
    worst, generated = lockstep_logits(embedded.model, prompts, steps=8, drop_at=3)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    for i in (0, 2):
        expected = generate_alone(embedded.model, prompts[i], len(generated[i]))  # stops at EOS, if any
        assert len(expected) >= 4 and generated[i][: len(expected)] == expected, f"branch {i}"


@needs_openblas
def test_real_model_lone_branch_on_openblas_matches_transformers_and_generate(embedded):
    """The embedded SmolLM2, one branch: every step's products on OpenBLAS (what one thread on an
    AVX-512 host runs), logits within float32 rounding, greedy tokens those of generate."""
    document = "The lighthouse keeper Mara climbed the hundred steps every evening. " * 12
    prompt = embedded.tokenizer(f"{document}\nQuestion: Who is Mara?\nAnswer:")["input_ids"]
    worst, generated = lockstep_logits(embedded.model, [prompt], steps=8, variant=("bmm", None), transposed=True,
                                       lone_blas=True, blocks=False)  # the float32 copies, not the .gguf's blocks
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    expected = generate_alone(embedded.model, prompt, len(generated[0]))
    assert len(expected) >= 4 and generated[0][: len(expected)] == expected


def test_packed_weights_are_made_once_per_model():
    if not onednn_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    model = tiny_model("llama", "sdpa")
    first, second = FastForward(model, packed=True), FastForward(model, packed=True)
    assert first.layers[0].qkv is second.layers[0].qkv
    assert model.model.layers[0].self_attn.q_proj.weight.layout == torch.strided  # the model keeps its own


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("arch", SUPPORTED)
def test_transposed_weights_for_lone_tokens_give_transformers_logits_and_generate_tokens(arch, packed):
    """The lone-token step on transposed weight copies (AVX2 hosts), wider steps on the others."""
    if packed and not onednn_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    model = tiny_model(arch, "sdpa")
    prompts = random_prompts(41, [6, 2, 8], seed=5)
    worst, _ = lockstep_logits(model, prompts, steps=8, drop_at=3, variant=("bmm", packed), transposed=True,
                               max_forward_tokens=16)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    alone = random_prompts(40, [5], seed=7)
    worst, generated = lockstep_logits(model, alone, steps=8, variant=("bmm", packed), transposed=True)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    assert generated[0] == generate_alone(model, alone[0], 8)


@needs_openblas
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("arch", SUPPORTED)
def test_lone_tokens_on_openblas_give_transformers_logits_and_generate_tokens(arch, packed):
    """A lone token's products (and its attention's weighted sum) on OpenBLAS over the transposed
    copies, wider steps on the others: logits within float32 rounding, the tokens of generate."""
    if packed and not onednn_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    model = tiny_model(arch, "sdpa")
    prompts = random_prompts(41, [6, 2, 8], seed=5)
    worst, _ = lockstep_logits(model, prompts, steps=8, drop_at=3, variant=("bmm", packed), transposed=True,
                               lone_blas=True, max_forward_tokens=16)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    alone = random_prompts(40, [5], seed=7)
    worst, generated = lockstep_logits(model, alone, steps=8, variant=("bmm", packed), transposed=True, lone_blas=True)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    assert generated[0] == generate_alone(model, alone[0], 8)


@pytest.mark.parametrize("arch", SUPPORTED)
def test_two_token_forwards_multiplied_as_four_rows_give_transformers_logits_and_generate_tokens(arch):
    """Two branches step as two-token forwards, which the packed weights multiply padded to four
    rows (AVX-512 hosts): logits within float32 rounding, each branch's tokens those of generate."""
    if not onednn_works():
        pytest.skip("packed weights need torch's oneDNN linear")
    model = tiny_model(arch, "sdpa")
    prompts = random_prompts(43, [4, 7], seed=11)
    worst, generated = lockstep_logits(model, prompts, steps=8, variant=("bmm", True), pair_padded=True)
    assert worst < 1e-4, f"max logit difference {worst:.2e}"
    for prompt, tokens in zip(prompts, generated):
        assert tokens == generate_alone(model, prompt, 8)


def test_pair_padding_changes_only_two_row_products_and_keeps_their_values():
    if not onednn_works():
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
    own._fast = FastForward(model, attention="bmm", packed=False, transposed=True, lone_blas=True)
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
    from tests.test_speculate import QUOTING, STORY, assert_branches_equal_generate, finishes

    torch_threads(1)
    runs = {s: list(ask_many(embedded, STORY, QUOTING, max_new_tokens=24, speculate=s)) for s in ("off", "16")}
    assert finishes(runs["16"]) == finishes(runs["off"])
    assert_branches_equal_generate(embedded.model, runs["off"])


def test_without_numpys_openblas_a_lone_token_keeps_torchs_kernels(monkeypatch, torch_threads):
    """numpy built on another BLAS (or threadpoolctl missing): no OpenBLAS path and, on an AVX-512
    host, no transposed copy for it; the step is what it was before."""
    from mdcli.backends.weights import blas as blas_gemv

    monkeypatch.setattr(blas_gemv, "openblas_library", lambda: None)
    torch_threads(1)
    cpu = torch.device("cpu")
    assert not blas_gemv.openblas_works()
    assert "OpenBLAS" not in str(kernel_choice(cpu, torch.float32))
    chosen = FastForward(tiny_model("llama", "sdpa"))
    assert not chosen.lone_blas
    if kernel_name(cpu, torch.float32) == "oneDNN":
        assert not chosen.transposed


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
    first, second = FastForward(model, packed=False, transposed=True), FastForward(model, packed=False, transposed=True)
    assert first.lone[0].qkv is second.lone[0].qkv and first.lone_head is second.lone_head
    assert torch.equal(first.lone[0].qkv, first.layers[0].qkv.t())
    assert first.layers[0].qkv.data_ptr() == model.model.layers[0].self_attn.q_proj.weight.data_ptr()


@pytest.fixture
def torch_threads():
    """Set torch's thread count inside a test; the count it had is restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_the_step_choices_follow_the_host_kind(monkeypatch, torch_threads):
    """AVX2-only x86-64 (measured on Zen 3): packed and transposed copies (MKL for a lone token, on
    one thread OpenBLAS, and a tiled copy for 2-64 tokens where mdcli's kernel builds), bmm attention
    up to 64 queries; oneDNN hosts (AVX-512): packed, bmm up to
    32 queries, and on one thread a transposed copy that a lone token multiplies on OpenBLAS, its
    weighted sum for forwards of up to 3 tokens (measured on Zen 4), on more threads no transposed
    copy; on both, on AMD cores, the cached keys and values read ahead for forwards of several
    tokens, and on AVX-512 two-row products padded to four (measured faster on Zen 4 and Zen 3,
    slower on an Intel Xeon); forced stock kernels: neither copy, sdpa, no reading ahead."""
    model = tiny_model("llama", "sdpa")
    cpu = torch.device("cpu")
    torch_threads(2)
    chosen = FastForward(model)
    if avx2_step(cpu, torch.float32):
        assert (chosen.packed, chosen.transposed, chosen.lone_blas, chosen.attention) == (True, True, False, "bmm")
        assert chosen.bmm_max_queries == BMM_MAX_QUERIES  # a long prefill attends with sdpa
        assert chosen.read_ahead == (cpu_vendor() == "AMD") and not chosen.pair_padded  # padding measured slower on Zen 3
        torch_threads(1)
        alone = FastForward(model)
        blas = openblas_works()
        assert (alone.transposed, alone.lone_blas, alone.blas_queries) == (True, blas, SMALL_BLAS_QUERIES_AVX2 * blas)
        assert ("a lone token on OpenBLAS" in kernel_choice(cpu, torch.float32).reason) == blas
        assert not chosen.tiled and alone.tiled == tiled_works()  # the kernel runs one thread
        assert ("tokens on mdcli's tiled kernel" in kernel_choice(cpu, torch.float32).reason) == alone.tiled
    elif kernel_name(cpu, torch.float32) == "oneDNN":
        assert (chosen.packed, chosen.transposed, chosen.lone_blas, chosen.attention) == (True, False, False, "bmm")
        assert chosen.bmm_max_queries == BMM_MAX_QUERIES_AVX512  # a long prefill attends with sdpa
        amd = cpu_vendor() == "AMD"  # both measured faster on Zen 4, slower on an Intel Xeon
        assert chosen.pair_padded == amd and chosen.read_ahead == amd
        torch_threads(1)
        alone = FastForward(model)
        blas = openblas_works()
        assert (alone.packed, alone.transposed, alone.lone_blas) == (True, blas, blas)
        assert not alone.tiled  # mdcli's AVX2 kernel is measured only on AVX2-only hosts
        assert alone.blas_queries == SMALL_BLAS_QUERIES * blas
        assert ("a lone token on OpenBLAS" in kernel_choice(cpu, torch.float32).reason) == blas
    monkeypatch.setenv("MDCLI_CPU_KERNELS", "torch")
    stock = FastForward(model)
    assert (stock.packed, stock.transposed, stock.pair_padded, stock.attention) == (False, False, False, "transformers")
    assert not stock.read_ahead and not stock.tiled  # forced stock kernels: no mdcli kernel either
    assert stock.bmm_max_queries is None
    monkeypatch.setenv("MDCLI_CPU_KERNELS", "auto")
    monkeypatch.setenv("MDCLI_PACKED_WEIGHTS", "0")
    unpacked = FastForward(model)
    assert not unpacked.packed and not unpacked.transposed and not unpacked.tiled
    monkeypatch.delenv("MDCLI_PACKED_WEIGHTS")
    monkeypatch.setenv("MDCLI_TILED_GEMM", "0")
    assert not FastForward(model).tiled
    monkeypatch.setenv("MDCLI_TILED_GEMM", "always")
    assert FastForward(model).tiled == tiled_works()


@pytest.mark.parametrize("arch", SUPPORTED)
def test_forwards_past_the_bmm_query_limit_attend_with_sdpa_and_agree(arch):
    """A forward of more queries than bmm_max_queries runs sdpa, one of fewer bmm, in the same
    forward object: the logits of a long prefill and of the steps after it are transformers'."""
    model = tiny_model(arch, "sdpa")
    hf = engine_for(model, own_forward=False)
    own = engine_for(model)
    own._fast = FastForward(model, attention="bmm", packed=False, transposed=False)
    own._fast.bmm_max_queries = 4  # the prompts' prefill (> 4 queries) goes to sdpa, the steps to bmm
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
