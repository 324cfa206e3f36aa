"""mdcli's kernel choices stay inside mdcli's own forwards.

The plan (mdcli.backends.select) is made per model at load, and the oneDNN routing of transformers'
forward is a torch function mode entered by that forward in its own thread: torch's and
transformers' functions are never replaced, so code beside mdcli in the same process (another
model, a plain `nn.Linear`, another thread) runs exactly as it would without mdcli.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mdcli.backends.attention.gemm import onednn_linear_works
from tests.reference import generate_alone
from tests.test_engine_exactness import engine_for, greedy_forest, random_prompts, settings_with, tiny_model

ONEDNN_OP = "mkldnn::_linear_pointwise"
needs_onednn = pytest.mark.skipif(not onednn_linear_works(), reason="this torch build has no working oneDNN linear")


def ops_run(fn) -> set[str]:
    """The operator names `fn` ran in this thread."""
    with profile() as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@needs_onednn
def test_a_forest_running_in_another_thread_leaves_torch_and_transformers_to_everyone_else():
    model = tiny_model("llama", "sdpa")

    def routed_engine():  # oneDNN routing whatever this host is, on transformers' forward (the routed path)
        return engine_for(model, settings=settings_with(cpu_kernels="onednn"), own_forward=False)

    assert ONEDNN_OP in ops_run(lambda: greedy_forest(routed_engine(), random_prompts(9, [2, 3]), 2))
    stock_linear, stock_sdpa = F.linear, ALL_ATTENTION_FUNCTIONS["sdpa"]
    other = tiny_model("qwen2", "sdpa")
    plain = torch.nn.Linear(64, 32)
    done = threading.Event()
    failures: list[BaseException] = []

    def forests() -> None:
        try:
            while not done.is_set():
                greedy_forest(routed_engine(), random_prompts(20, [3, 5, 2]), 4)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            failures.append(error)

    worker = threading.Thread(target=forests)
    worker.start()
    try:
        seen: set[str] = set()
        for _ in range(20):
            assert F.linear is stock_linear and ALL_ATTENTION_FUNCTIONS["sdpa"] is stock_sdpa
            assert torch.nn.functional.linear is stock_linear
            with torch.inference_mode():
                seen |= ops_run(lambda: (plain(torch.randn(5, 64)), other(torch.tensor([[3, 4, 5, 6]]))))
        assert "aten::linear" in seen  # the evidence is there: the plain layers ran in this thread
        assert ONEDNN_OP not in seen
    finally:
        done.set()
        worker.join()
    assert not failures, failures


@needs_onednn
def test_two_models_with_different_plans_in_one_process_are_both_exact_side_by_side():
    routed = tiny_model("llama", "sdpa")
    stock = tiny_model("qwen2", "sdpa")
    prompts = random_prompts(30, [4, 1, 9], seed=5)
    engines = {
        "routed": engine_for(routed, settings=settings_with(cpu_kernels="onednn")),
        "stock": engine_for(stock, settings=settings_with(cpu_kernels="torch", packed_weights=False)),
    }
    assert engines["routed"].model_forward.plan.linears.name == "oneDNN"
    assert engines["stock"].model_forward.plan.linears.name == "torch"
    assert not engines["stock"].model_forward.plan.packed
    results: dict[str, list[list[int]]] = {}

    def decode(name: str) -> None:
        results[name] = greedy_forest(engines[name], prompts, steps=10, drop_at=3)

    threads = [threading.Thread(target=decode, args=(name,)) for name in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, model in (("routed", routed), ("stock", stock)):
        for i, prompt in enumerate(prompts):
            assert results[name][i] == generate_alone(model, prompt, len(results[name][i])), f"{name} branch {i}"


def test_the_plan_is_made_once_at_load_and_read_by_every_run(embedded):
    from mdcli.core.run import Run

    plan = embedded.forward.plan
    first, second = Run.for_model(embedded), Run.for_model(embedded)
    assert first.engine.model_forward is second.engine.model_forward is embedded.forward
    assert first.engine.model_forward.plan is plan
    assert embedded.forward.describe() == plan.describe()


def test_mdcli_keeps_no_state_on_the_models_it_runs(embedded):
    """Weight copies, .gguf blocks and their source are held beside the model (weakly), not on it."""
    from mdcli.api import ask_many

    list(ask_many(embedded, "Mara kept the lighthouse.", ["Who?", "Where?"], max_new_tokens=3))
    if not (embedded.forward.plan.packed or embedded.forward.plan.blocks):
        pytest.skip("this host's plan makes no weight copies to look for")
    on_the_model = [(name, key) for name, module in embedded.model.named_modules()
                    for key in vars(module) if "mdcli" in key]
    assert on_the_model == []


def test_grouped_sdpa_is_transformers_sdpa_with_grouped_heads_read_natively():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mdcli.backends.reference import grouped_sdpa

    class Attention(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 5, 16, generator=generator)
    k, v = (torch.randn(1, 2, 12, 16, generator=generator) for _ in range(2))
    allowed = torch.rand(5, 12, generator=generator) < 0.6
    allowed[:, -5:] |= torch.eye(5, dtype=torch.bool)
    mask = torch.zeros(5, 12).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    want, _ = sdpa_attention_forward(Attention(), q, k, v, mask, scaling=0.25)  # [1, 5, 6, 16]
    got, weights = grouped_sdpa(Attention(), q, k, v, mask, scaling=0.25)
    assert weights is None and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_masked_reference_forward_attends_through_grouped_sdpa_and_gives_the_config_back():
    from mdcli.backends.reference import GROUPED_SDPA

    model = tiny_model("qwen2", "sdpa")  # 4 query heads over 2 key/value heads
    seen: list[str] = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._attn_implementation))
    prompts = random_prompts(12, [3, 4], seed=2)
    generated = greedy_forest(engine_for(model, own_forward=False), prompts, steps=3)
    assert GROUPED_SDPA in seen and "sdpa" in seen  # masked forwards grouped, the shared causal prefill stock
    assert model.config._attn_implementation == "sdpa"
    for i, prompt in enumerate(prompts):
        assert generated[i] == generate_alone(model, prompt, len(generated[i])), f"branch {i}"
