"""mdcli's float32 CPU forwards run linears and masked attention on oneDNN: the same results to
float32 rounding, only inside mdcli's own forwards (a torch function mode local to the forward's
thread, nothing in torch or transformers replaced), and never where they do not apply (autograd,
other dtypes, one query, attention extras, the opt-out). Where oneDNN is chosen is a rule on the
host (mdcli.backends.select.linear_kernels), stated here for each host kind."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack
from torch.profiler import profile
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mdcli.backends import llama
from mdcli.backends.attention import gemm
from mdcli.backends.attention.gemm import (
    MAX_GEMM_ATTENTION_QUERIES,
    KeySpan,
    gemm_attention,
    gemm_attention_applies,
    key_spans,
    onednn_linear_works,
    pieced_attention,
    routed_linear,
)
from mdcli.backends.forward import causal_mask
from mdcli.backends.reference import OneDnnRouting
from mdcli.backends.select import Host, linear_kernels, select
from mdcli.bench.kernels import random_forest_mask
from mdcli.core import cache as kv
from mdcli.errors import UsageError
from tests.test_engine_exactness import (
    engine_for,
    random_prompts,
    settings_with,
    tiny_model,
)

ONEDNN_OP = "mkldnn::_linear_pointwise"
FLASH_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"
CPU = torch.device("cpu")

# the routing's mechanics need torch's oneDNN linear; the rules below state hosts of every kind
needs_onednn = pytest.mark.skipif(not onednn_linear_works(), reason="this torch build has no oneDNN linear")
ONEDNN = settings_with(cpu_kernels="onednn")  # the routing's mechanics are tested on every host with oneDNN
TORCH = settings_with(cpu_kernels="torch")


def ops_run(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {event.key for event in prof.key_averages()}


def host(capability: str = "AVX512", machine: str = "x86_64", *, onednn: bool = True) -> Host:
    """A host of the kind named, its oneDNN probe answering `onednn`."""
    return Host(machine, capability, "AMD", 1, onednn=lambda: onednn)


def stock_functions() -> tuple:
    """What torch and transformers hold now: the tests check that mdcli never replaces them."""
    return F.linear, torch.nn.functional.linear, F.scaled_dot_product_attention, ALL_ATTENTION_FUNCTIONS["sdpa"]


STOCK = stock_functions()


def assert_untouched() -> None:
    assert stock_functions() == STOCK and all(a is b for a, b in zip(stock_functions(), STOCK))
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping


# -- linears --------------------------------------------------------------------------------------


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (1, 5, 576), (2, 3, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_computes_torchs_linear_to_float32_rounding(shape, bias):
    generator = torch.Generator().manual_seed(len(shape) + shape[0])
    x = torch.randn(*shape, generator=generator)
    w = torch.randn(1536, 576, generator=generator)
    b = torch.randn(1536, generator=generator) if bias else None
    want = F.linear(x, w, b)
    for routed in (lambda: routed_linear(x, w, b), lambda: _routed_call(lambda: F.linear(x, w, b))):
        got = routed()
        assert ONEDNN_OP in ops_run(routed)
        assert got.shape == want.shape
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def _routed_call(fn):
    with OneDnnRouting():
        return fn()


@needs_onednn
def test_the_routing_ends_with_its_context_even_after_an_error_and_never_replaces_torchs_functions():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(KeyboardInterrupt), OneDnnRouting():
        assert_untouched()  # routed by a mode, not by replacing F.linear or transformers' sdpa
        assert ONEDNN_OP in ops_run(lambda: F.linear(x, w))
        raise KeyboardInterrupt
    assert_untouched()
    assert _get_current_function_mode_stack() == []
    assert ONEDNN_OP not in ops_run(lambda: F.linear(x, w))


@needs_onednn
def test_the_routing_is_local_to_its_thread_and_nested_contexts_leave_it_once_all_have_left():
    """Another thread's products keep torch's kernels while one thread is inside the routing,
    nested once more; once it has left, nothing is routed anywhere."""
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    inside, leave = threading.Event(), threading.Event()
    seen: dict[str, set[str] | list] = {}

    def other_thread():
        inside.wait(5)
        seen["modes"] = list(_get_current_function_mode_stack())
        seen["ops"] = ops_run(lambda: F.linear(x, w))
        leave.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with OneDnnRouting():
        with OneDnnRouting():
            inside.set()
            leave.wait(5)
            assert ONEDNN_OP in ops_run(lambda: F.linear(x, w))
        assert ONEDNN_OP in ops_run(lambda: F.linear(x, w))  # the outer context still routes
    worker.join(5)
    assert seen["modes"] == []
    assert "aten::linear" in seen["ops"] and ONEDNN_OP not in seen["ops"]  # the other thread's, on torch's kernels
    assert ONEDNN_OP not in ops_run(lambda: F.linear(x, w))
    assert_untouched()


@needs_onednn
def test_autograd_and_other_dtypes_keep_torchs_own_linear():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(4, 8)
    with OneDnnRouting():
        assert ONEDNN_OP not in ops_run(lambda: F.linear(x, w).sum().backward())
        assert ONEDNN_OP not in ops_run(lambda: F.linear(x.detach().double(), w.double()))
    assert x.grad is not None and x.grad.shape == x.shape


@needs_onednn
def test_the_opt_out_and_non_float32_models_get_no_routing():
    auto = settings_with(cpu_kernels="auto")
    assert linear_kernels(CPU, torch.float32, auto, host("AVX512")).name == "oneDNN"
    assert linear_kernels(CPU, torch.bfloat16, auto, host("AVX512")).name == "torch"
    assert linear_kernels(torch.device("cuda"), torch.float32, auto, host("AVX512")).name == "torch"
    assert linear_kernels(CPU, torch.float32, TORCH, host("AVX512")).name == "torch"
    model = tiny_model("llama", "sdpa")
    engine = engine_for(model, settings=TORCH, own_forward=False)
    assert engine.model_forward.plan.linears.name == "torch" and not engine.model_forward.reference.onednn
    prompts = random_prompts(12, [2, 3])
    root = torch.zeros(2, 0, dtype=torch.bool)
    ran = ops_run(lambda: engine.forward(root, [prompts[0], prompts[1]]))
    assert ONEDNN_OP not in ran and FLASH_OP in ran
    assert_untouched()


@pytest.mark.parametrize("capability, machine, setting, expected", [
    ("AVX512", "x86_64", "auto", "oneDNN"),  # measured faster there: the default
    ("AVX512_BF16", "x86_64", "auto", "oneDNN"),  # any AVX-512 capability
    ("AVX512", "amd64", "auto", "oneDNN"),  # Windows spells x86-64 so
    ("AVX2", "x86_64", "auto", "torch"),  # measured slower on an AVX2-only Zen 3: torch's own kernels
    ("AVX2", "x86_64", "onednn", "oneDNN"),  # forced
    ("AVX512", "x86_64", "torch", "torch"),  # opted out
    ("AVX512", "arm64", "auto", "torch"),  # never measured off x86-64
    ("AVX512", "arm64", "onednn", "oneDNN"),  # forced, where oneDNN works
    ("DEFAULT", "x86_64", "auto", "torch"),
])
def test_routing_is_chosen_by_what_pays_on_this_cpu(capability, machine, setting, expected):
    choice = linear_kernels(CPU, torch.float32, settings_with(cpu_kernels=setting), host(capability, machine))
    assert choice.name == expected
    assert choice.reason  # the header and bench say why


@pytest.mark.parametrize("setting", ["auto", "onednn"])
def test_without_a_working_onednn_every_host_keeps_torchs_kernels(setting):
    choice = linear_kernels(CPU, torch.float32, settings_with(cpu_kernels=setting), host("AVX512", onednn=False))
    assert str(choice) == "torch (no working oneDNN in this torch build)"


def test_the_reason_names_the_cpu_feature_or_the_setting():
    avx2 = host("AVX2")
    assert str(linear_kernels(CPU, torch.float32, settings_with(cpu_kernels="auto"), avx2)).startswith(
        "torch (AVX2 without AVX-512")
    assert "MDCLI_CPU_KERNELS=torch" in str(linear_kernels(CPU, torch.float32, TORCH, avx2))
    assert "forced by MDCLI_CPU_KERNELS=onednn" in str(linear_kernels(CPU, torch.float32, ONEDNN, avx2))


def test_the_plan_describes_the_routing_it_chose():
    model = tiny_model("llama", "sdpa")
    plan = select(model, settings_with(cpu_kernels="auto"), Host("x86_64", "AVX2", "AMD", 2, onednn=lambda: True))
    assert plan.linears.name == "torch" and plan.describe().startswith("torch (AVX2 without AVX-512")
    plan = select(model, settings_with(cpu_kernels="auto"), Host("x86_64", "AVX512", "Intel", 2, onednn=lambda: True))
    assert plan.linears.name == "oneDNN" and plan.describe().startswith("oneDNN (AVX-512: measured faster there")


def test_an_unknown_kernel_setting_is_a_usage_error_naming_the_choices():
    with pytest.raises(UsageError, match="auto, torch or onednn") as raised:
        settings_with(cpu_kernels="fastest")
    assert "MDCLI_CPU_KERNELS='fastest' is not valid" in str(raised.value)


# -- attention ------------------------------------------------------------------------------------


def forest_mask(queries: int, keys: int, seed: int) -> torch.Tensor:
    return random_forest_mask(queries, keys, torch.Generator().manual_seed(seed))


class Attention(torch.nn.Module):
    """What transformers passes as `module`: only num_key_value_groups is read."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


ATTENTION_SHAPES = [(9, 3, 8, 300, None), (4, 4, 5, 64, 0.3), (8, 1, 2, 100, None), (6, 2, 17, 257, 0.125)]


@needs_onednn
@pytest.mark.parametrize("heads, kv_heads, queries, keys, scaling", ATTENTION_SHAPES)
def test_masked_attention_on_onednn_equals_sdpa_to_float32_rounding(heads, kv_heads, queries, keys, scaling):
    """transformers' own sdpa function, run inside the routing: its sdpa call becomes oneDNN products."""
    generator = torch.Generator().manual_seed(heads * keys)
    q = torch.randn(1, heads, queries, 32, generator=generator)
    k, v = (torch.randn(1, kv_heads, keys, 32, generator=generator) for _ in range(2))
    mask = forest_mask(queries, keys, seed=keys)
    module = Attention(heads // kv_heads)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with torch.inference_mode():
        want, _ = sdpa(module, q, k, v, mask, scaling=scaling)
        with OneDnnRouting():
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa  # nothing replaced
            got, _ = sdpa(module, q, k, v, mask, scaling=scaling)
            ran = ops_run(lambda: sdpa(module, q, k, v, mask, scaling=scaling))
    assert ONEDNN_OP in ran and FLASH_OP not in ran
    assert got.shape == want.shape == (1, queries, heads, 32)
    assert float((got - want).abs().max()) < 1e-5


@needs_onednn
@pytest.mark.parametrize("heads, kv_heads, queries, keys, scaling", ATTENTION_SHAPES)
def test_grouped_heads_read_natively_give_sdpas_attention(heads, kv_heads, queries, keys, scaling):
    """torch's sdpa with grouped heads (enable_gqa), routed and direct (`gemm_attention`, sdpa's
    [1, H, M, Dv] layout): query head h reads key/value head h // (H / G), as sdpa pairs them."""
    generator = torch.Generator().manual_seed(heads * keys + 1)
    q = torch.randn(1, heads, queries, 32, generator=generator)
    k, v = (torch.randn(1, kv_heads, keys, 32, generator=generator) for _ in range(2))
    mask = forest_mask(queries, keys, seed=keys + 1)
    with torch.inference_mode():
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        assert gemm_attention_applies(q, k, v, mask)
        direct = gemm_attention(q, k, v, mask, scaling)
        with OneDnnRouting():
            routed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
            ran = ops_run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                                                 enable_gqa=True))
    assert ONEDNN_OP in ran and FLASH_OP not in ran
    for got in (direct, routed):
        assert got.shape == want.shape == (1, heads, queries, 32)
        assert float((got - want).abs().max()) < 1e-5


def test_a_causal_masks_spans_read_the_cache_and_their_own_rows_and_mask_only_the_last_ones():
    """A causal piece of 200 queries after 100 cached slots, 64 queries a span: span [s, e) sees
    slots 0 .. 100 + e - 1, and the mask changes only columns from 100 + s + 1 (its upper triangle)."""
    spans = key_spans(causal_mask(200, 100, torch.float32), 64)
    assert spans == tuple(KeySpan(s, min(s + 64, 200), 100 + s + 1, 100 + min(s + 64, 200)) for s in range(0, 200, 64))
    assert key_spans(causal_mask(1, 7, torch.float32), 64) == (KeySpan(0, 1, 8, 8),)  # one query: no mask to add


def test_spans_of_a_forest_mask_reach_the_last_column_any_of_their_rows_sees():
    mask = forest_mask(40, 300, seed=3)
    mask[0, 0, :16, 250:] = torch.finfo(torch.float32).min  # the first span sees nothing past 250
    mask[0, 0, :16, 100] = float("-inf")  # -inf hides a column as the dtype's lowest value does
    spans = key_spans(mask, 16)
    assert [(s.start, s.stop) for s in spans] == [(0, 16), (16, 32), (32, 40)]
    for span in spans:
        rows = mask[0, 0, span.start:span.stop]
        seen = (rows > torch.finfo(torch.float32).min).any(0).nonzero()[:, 0]
        changed = (rows[:, : span.reach] != 0).any(0).nonzero()[:, 0]
        assert span.reach == int(seen[-1]) + 1 and span.zero == int(changed[0])
    assert spans[0].reach <= 250


def test_a_span_whose_rows_see_nothing_reads_every_column_as_unpieced_attention_does():
    mask = torch.full((1, 1, 4, 10), torch.finfo(torch.float32).min)
    assert key_spans(mask, 2) == (KeySpan(0, 2, 0, 10), KeySpan(2, 4, 0, 10))


@needs_onednn
@pytest.mark.parametrize("piece", [1, 7, 64, 128])
@pytest.mark.parametrize("heads, kv_heads, queries, keys, scaling", ATTENTION_SHAPES)
def test_attention_piece_by_piece_equals_attention_over_every_key(piece, heads, kv_heads, queries, keys, scaling):
    """On forest masks and on causal ones: the columns a span's rows cannot see weigh 0."""
    generator = torch.Generator().manual_seed(heads * keys + piece)
    q = torch.randn(1, heads, queries, 32, generator=generator)
    k, v = (torch.randn(1, kv_heads, keys, 32, generator=generator) for _ in range(2))
    for mask in (forest_mask(queries, keys, seed=keys + piece), causal_mask(queries, keys - queries, torch.float32)):
        with torch.inference_mode():
            want = gemm_attention(q, k, v, mask, scaling)
            got = pieced_attention(q, k, v, mask, scaling, key_spans(mask, piece))
        assert got.shape == want.shape == (1, heads, queries, 32)
        assert float((got - want).abs().max()) < 1e-5


@needs_onednn
def test_the_own_forwards_causal_pieces_attend_span_by_span_on_onednn(monkeypatch):
    """A prefill on the sdpa core with oneDNN's products reads each span's keys only: the forward
    hands its spans to the attention, computed once a forward, not once a layer."""
    model = tiny_model("llama", "sdpa")
    own = llama.FastForward(model, select(model, settings_with(cpu_kernels="onednn")))
    if not own.onednn:
        pytest.skip("the plan keeps torch's kernels on this host")
    spans_made, pieced = [], []
    monkeypatch.setattr(llama, "key_spans", lambda mask: spans_made.append(mask) or key_spans(mask))
    monkeypatch.setattr(gemm, "pieced_attention", lambda *a: pieced.append(a[-1]) or pieced_attention(*a))
    queries = own.bmm_max_queries + 1 if own.bmm_max_queries else MAX_GEMM_ATTENTION_QUERIES
    tokens = torch.randint(0, model.config.vocab_size, (queries,), generator=torch.Generator().manual_seed(0))
    mask = causal_mask(queries, 0, torch.float32)
    with torch.inference_mode():
        own(tokens, torch.arange(queries), mask, kv.new_cache(), torch.tensor([queries - 1]))
    assert len(spans_made) == 1 and len(pieced) == model.config.num_hidden_layers
    assert pieced[0] == key_spans(mask)


@needs_onednn
@pytest.mark.parametrize("case", ["one query", "no mask", "causal", "dropout", "bool mask", "autograd", "bf16",
                                  "too many queries"])
def test_attention_it_does_not_cover_keeps_torchs_kernels(case):
    queries = MAX_GEMM_ATTENTION_QUERIES + 1 if case == "too many queries" else 3
    q, k, v = torch.randn(1, 4, queries, 16), torch.randn(1, 4, 10 + queries, 16), torch.randn(1, 4, 10 + queries, 16)
    mask, extras = forest_mask(queries, 10 + queries, seed=0), {}
    if case == "one query":
        q, mask = q[:, :, :1], mask[:, :, :1]
    elif case == "no mask":
        mask = None
    elif case == "causal":
        mask, extras["is_causal"] = None, True
    elif case == "dropout":
        extras["dropout_p"] = 0.5
    elif case == "bool mask":
        mask = mask == 0
    elif case == "bf16":
        q, k, v, mask = (t.bfloat16() for t in (q, k, v, mask))
    grad = torch.enable_grad() if case == "autograd" else torch.inference_mode()
    if case == "autograd":
        q.requires_grad_(True)
    with grad, OneDnnRouting():
        ran = ops_run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extras))
    assert ONEDNN_OP not in ran


@needs_onednn
@pytest.mark.parametrize("case", ["softcap", "sinks", "position bias"])
def test_extras_of_transformers_sdpa_function_keep_its_own_behaviour_under_the_routing(case):
    """transformers' sdpa function is never replaced: softcap is refused as it refuses it, and what
    it passes on to torch's sdpa (a position bias folded into the mask; sinks it does not read) is
    computed as torch computes it, to float32 rounding."""
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    mask, module, extras = forest_mask(3, 10, seed=0), Attention(2), {}
    if case == "softcap":
        extras["softcap"] = 30.0
    elif case == "sinks":  # a tensor per head, as gpt-oss passes them
        extras["s_aux"] = torch.zeros(4)
    else:
        extras["position_bias"] = torch.randn(1, 4, 3, 10)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with torch.inference_mode():
        if case == "softcap":
            with OneDnnRouting(), pytest.raises(ValueError, match="softcap"):
                sdpa(module, q, k, v, mask, **extras)
            return
        want, _ = sdpa(module, q, k, v, mask, **extras)
        with OneDnnRouting():
            got, _ = sdpa(module, q, k, v, mask, **extras)
    assert float((got - want).abs().max()) < 1e-5


# -- the engine -----------------------------------------------------------------------------------


def _identity_probe(model, record: list):
    """A hook on the model's rotary module (called by both forwards) that notes, from inside the
    forward, whether torch's and transformers' functions are still their own and whether the
    routing is entered."""

    def hook(module, args):
        record.append((all(a is b for a, b in zip(stock_functions(), STOCK)),
                       "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping,
                       any(isinstance(mode, OneDnnRouting) for mode in _get_current_function_mode_stack())))

    return model.model.rotary_emb.register_forward_pre_hook(hook)


@needs_onednn
@pytest.mark.parametrize("own_forward", [True, False], ids=["own-forward", "transformers-forward"])
@pytest.mark.parametrize("setting, expected", [("onednn", True), ("torch", False)])
def test_engine_forwards_use_onednn_when_chosen_and_replace_nothing(setting, expected, own_forward):
    assert_untouched()
    model = tiny_model("llama", "sdpa")
    engine = engine_for(model, settings=settings_with(cpu_kernels=setting), own_forward=own_forward)
    assert (engine.model_forward.plan.linears.name == "oneDNN") is expected
    prompts = random_prompts(12, [2, 3])
    root = torch.zeros(2, 0, dtype=torch.bool)
    record: list = []
    handle = _identity_probe(model, record)
    try:
        ran = ops_run(lambda: engine.forward(root, [prompts[0], prompts[1]]))  # two roots: masked
    finally:
        handle.remove()
    assert (ONEDNN_OP in ran) is expected
    assert (FLASH_OP not in ran) is expected  # the masked attention ran on oneDNN (or bmm) too
    assert record and all(same and not_local for same, not_local, _ in record)
    # the mode is entered around transformers' forward only: mdcli's own calls oneDNN itself
    assert all(entered == (expected and not own_forward) for *_, entered in record)
    assert_untouched()
    assert _get_current_function_mode_stack() == []
    ran = ops_run(lambda: model(torch.tensor([prompts[0]])))
    assert ONEDNN_OP not in ran and "aten::linear" in ran  # the plain model, outside the engine, is untouched


@needs_onednn
def test_another_threads_linear_and_transformers_forward_keep_torchs_kernels_during_an_engine_forward():
    """While one thread is inside an engine forward routed to oneDNN, a plain torch.nn.Linear and
    transformers' own forward of another model run on torch's kernels in another thread; after
    it, also in this one."""
    model = tiny_model("llama", "sdpa")
    other = tiny_model("qwen2", "sdpa")
    linear = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    engine = engine_for(model, settings=ONEDNN, own_forward=False)
    prompts = random_prompts(12, [2, 3])
    root = torch.zeros(2, 0, dtype=torch.bool)
    assert ONEDNN_OP in ops_run(lambda: engine_for(model, settings=ONEDNN, own_forward=False).forward(
        root, [prompts[0], prompts[1]]))
    inside, done = threading.Event(), threading.Event()
    seen: dict = {}

    def hook(module, args):  # inside the engine's forward: hold it there while the other thread runs
        seen["engine_routed"] = any(isinstance(m, OneDnnRouting) for m in _get_current_function_mode_stack())
        inside.set()
        done.wait(30)

    def other_thread():
        inside.wait(30)
        seen["modes"] = list(_get_current_function_mode_stack())
        with torch.inference_mode():
            seen["linear"] = ops_run(lambda: linear(x))
            seen["model"] = ops_run(lambda: other(torch.tensor([prompts[0]])))
        seen["untouched"] = all(a is b for a, b in zip(stock_functions(), STOCK))
        done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    handle = model.model.layers[0].register_forward_pre_hook(hook)
    try:
        engine.forward(root, [prompts[0], prompts[1]])
    finally:
        handle.remove()
        done.set()
    worker.join(30)
    assert seen["engine_routed"] and seen["modes"] == [] and seen["untouched"]
    for ran in (seen["linear"], seen["model"]):
        assert "aten::linear" in ran and ONEDNN_OP not in ran
    with torch.inference_mode():
        assert ONEDNN_OP not in ops_run(lambda: linear(x)) | ops_run(lambda: other(torch.tensor([prompts[0]])))
    assert_untouched()
