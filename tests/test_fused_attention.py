"""mdcli's attention kernel (mdcli.backends.attention.fused): torch's attention to float32 rounding,
for every shape a forest step gives it, and the forest's tokens through the engine on it."""

from __future__ import annotations

import pytest
import torch

from mdcli.backends.attention import fused
from mdcli.backends.native import build
from mdcli.backends.select import Host, select
from tests.reference import generate_alone
from tests.test_engine_exactness import engine_for, greedy_forest, random_prompts, tiny_model
from tests.test_llama_forward import BMM_ONLY, kind, lockstep_logits, own_variant, settings_with
from tests.test_sparse_attention import SUPPORTED, model_for

needs_kernel = pytest.mark.skipif(fused.library() is None, reason="mdcli's attention kernel needs x86-64 with AVX2 and a C compiler")
LOWEST = torch.finfo(torch.float32).min


def engine_on_kernel(model):
    """An engine whose dense attention runs on mdcli's kernel whatever this host's plan says (no sparse plans)."""
    engine = engine_for(model, settings=settings_with(sparse_attention="off"))
    own_variant(engine, **{**BMM_ONLY, "fused_attention": True})
    return engine


def torch_attention(query, keys, values, mask, scale):
    """sdpa with each key/value head repeated for its query heads, as transformers pairs them: [1, M, H * D]."""
    heads, groups = query.shape[1], keys.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(heads // groups, 1), values.repeat_interleave(heads // groups, 1),
        attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(1, query.shape[2], -1)


def cache_views(groups: int, n: int, dim: int, generator, spare: int = 37):
    """Keys and values [1, G, N, D] as the cache hands them over: views of a longer buffer."""
    return [torch.randn(1, groups, n + spare, dim, generator=generator)[:, :, :n] for _ in range(2)]


@needs_kernel
@pytest.mark.parametrize("heads, groups", [(9, 3), (4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("queries", [1, 2, 3, 8, 17, 64])
@pytest.mark.parametrize("slots", [1, 5, 130, 1027])
@pytest.mark.parametrize("dim", [64, 128, 16])
def test_the_kernel_gives_torchs_attention_for_every_step_shape(heads, groups, queries, slots, dim):
    """Query heads stacked per group (padded to the vector width), keys four at a time and the
    rest, values 32 keys a tile: every remainder, within float32 rounding of sdpa, each query seeing a
    random part of the cache (always its last slot)."""
    generator = torch.Generator().manual_seed(queries * slots + dim)
    query = torch.randn(1, heads, queries, dim, generator=generator)
    keys, values = cache_views(groups, slots, dim, generator)
    allowed = torch.rand(queries, slots, generator=generator) < 0.6
    allowed[:, -1] = True
    mask = torch.zeros(queries, slots).masked_fill_(~allowed, LOWEST)[None, None]
    ours = fused.fused_attention(query, keys, values, fused.step_mask(mask, heads // groups), dim**-0.5, groups)
    assert ours.shape == (1, queries, heads * dim)
    torch.testing.assert_close(ours, torch_attention(query, keys, values, mask, dim**-0.5), rtol=1e-4, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("heads, groups, queries", [(9, 3, 1), (32, 8, 1), (9, 3, 8), (6, 1, 2)])
def test_attention_is_the_same_numbers_on_any_thread_count(heads, groups, queries):
    """With torch on several threads the kernel splits its runs (the key/value groups) among them,
    each by the same code into its own columns: bit for bit the one-thread attention, lone queries
    (the few-rows path) and stacked ones alike."""
    generator = torch.Generator().manual_seed(heads + queries)
    query = torch.randn(1, heads, queries, 64, generator=generator)
    keys, values = cache_views(groups, 700, 64, generator)
    allowed = torch.rand(queries, 700, generator=generator) < 0.6
    allowed[:, -1] = True
    mask = fused.step_mask(torch.zeros(queries, 700).masked_fill_(~allowed, LOWEST)[None, None], heads // groups)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = fused.fused_attention(query, keys, values, mask, 0.125, groups)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(fused.fused_attention(query, keys, values, mask, 0.125, groups), alone), threads
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("heads, groups, queries", [(9, 3, 1), (9, 3, 8), (6, 1, 2), (5, 5, 1)])
@pytest.mark.parametrize("slots", [1600, 4000])
@pytest.mark.parametrize("gathered", [False, True])
def test_a_groups_keys_in_parts_give_torchs_attention_the_same_on_any_thread_count(heads, groups, queries, slots,
                                                                                   gathered):
    """Where the groups are not a power of two a long cache's keys are cut into parts (2 and 5
    here), each its own run, merged after: torch's attention within float32 rounding, rows that see
    none of a part's keys (their weight there 0) and a row that sees one slot of the last part (that
    slot's value, exactly); the parts come from the call's shape, so 1, 2 and 3 threads give the
    same numbers. gathered: the keys read through chosen slots (a document's own, in place)."""
    generator = torch.Generator().manual_seed(slots + queries)
    query = torch.randn(1, heads, queries, 64, generator=generator)
    keys, values = cache_views(groups, slots + 50, 64, generator)
    chosen = torch.arange(slots) + 50 if gathered else None  # the cache's slots 50 .. slots + 49
    seen_keys, seen_values = (keys[:, :, 50:], values[:, :, 50:]) if gathered else (keys[:, :, :slots], values[:, :, :slots])
    if not gathered:
        keys, values = seen_keys, seen_values
    allowed = torch.rand(queries, slots, generator=generator) < 0.6
    allowed[:, : slots // 2] = False  # the first parts unseen by every row
    allowed[:, -1] = True
    allowed[0] = False
    allowed[0, slots - 3] = True  # query 0 sees one slot, in the last part
    mask = torch.zeros(queries, slots).masked_fill_(~allowed, LOWEST)[None, None]
    step_mask = fused.step_mask(mask, heads // groups)
    expected = torch_attention(query, seen_keys, seen_values, mask, 0.125)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = fused.fused_attention(query, keys, values, step_mask, 0.125, groups, slots=chosen)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(fused.fused_attention(query, keys, values, step_mask, 0.125, groups, slots=chosen),
                               alone), threads
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(alone, expected, rtol=1e-4, atol=2e-6)
    for head in range(heads):  # query 0's rows: its one slot's value, exactly
        assert torch.equal(alone[0, 0, head * 64 : (head + 1) * 64], seen_values[0, head // (heads // groups), slots - 3])


@pytest.mark.skipif(build.x86_capability() != "AVX512", reason="the AVX2 build beside this host's own: an AVX-512 host")
@pytest.mark.parametrize("queries", [1, 8])
def test_the_avx2_build_merges_a_groups_key_parts_as_the_avx512_build_does(queries):
    """The AVX2 build (8 lanes, no few-rows path) of the same source, on an AVX-512 host where the
    suite otherwise runs the AVX-512 build: 3 groups over 1,600 slots in 2 parts, the first unseen,
    torch's attention within float32 rounding (on an AVX2 host the tests above run this build)."""
    lib = fused.bound(build.load(fused.SOURCE, build.X86_FLAGS["AVX2"]))
    generator = torch.Generator().manual_seed(queries)
    query = torch.randn(1, 9, queries, 64, generator=generator)
    keys, values = cache_views(3, 1600, 64, generator)
    allowed = torch.rand(queries, 1600, generator=generator) < 0.6
    allowed[:, :800] = False
    allowed[:, -1] = True
    mask = torch.zeros(queries, 1600).masked_fill_(~allowed, LOWEST)[None, None]
    padded = torch.zeros(1600, lib.attention_rows(3, queries))  # the mask's rows padded to this build's lanes
    padded[:, : 3 * queries] = mask[0, 0].repeat(3, 1).t()
    ours = fused.fused_attention(query, keys, values, fused.StepMask(padded), 0.125, 3, lib)
    torch.testing.assert_close(ours, torch_attention(query, keys, values, mask, 0.125), rtol=1e-4, atol=2e-6)


@needs_kernel
def test_without_a_mask_every_query_sees_the_whole_cache():
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 9, 4, 64, generator=generator)
    keys, values = cache_views(3, 1825, 64, generator)
    ours = fused.fused_attention(query, keys, values, None, 0.125, 3)
    torch.testing.assert_close(ours, torch_attention(query, keys, values, None, 0.125), rtol=1e-4, atol=2e-6)


@needs_kernel
def test_a_query_that_sees_one_slot_gets_that_slots_value_and_large_scores_do_not_overflow():
    """exp runs on the score minus its row's maximum: scores in the thousands give torch's answer,
    and a row whose mask leaves one slot gets exactly that slot's value."""
    generator = torch.Generator().manual_seed(2)
    query = 300 * torch.randn(1, 2, 3, 32, generator=generator)
    keys, values = cache_views(1, 50, 32, generator)
    allowed = torch.rand(3, 50, generator=generator) < 0.5
    allowed[0] = False
    allowed[0, 17] = True  # query 0 sees slot 17 only
    mask = torch.zeros(3, 50).masked_fill_(~allowed, LOWEST)[None, None]
    ours = fused.fused_attention(query, keys, values, fused.step_mask(mask, 2), 1.0, 1)
    torch.testing.assert_close(ours, torch_attention(query, keys, values, mask, 1.0), rtol=1e-4, atol=1e-5)
    assert torch.equal(ours[0, 0, :32], values[0, 0, 17])


@needs_kernel
def test_where_the_kernel_builds_it_passes_the_check_the_plan_relies_on():
    assert fused.fused_works()


def test_the_kernel_serves_head_sizes_its_value_chunks_divide():
    if fused.library() is None:
        assert not fused.fused_serves(64)
        return
    assert fused.fused_serves(64) and fused.fused_serves(128)
    assert not fused.fused_serves(66)


def test_the_plan_takes_the_kernel_on_amd_hosts_where_it_serves_the_head_size():
    """AMD x86-64 hosts with the kernel, AVX2-only (Zen 3) or AVX-512 (Zen 5): dense forwards of a
    few queries on it (measured faster there); not on Intel's AVX-512 hosts (measured slower on a
    Xeon), with torch's stock kernels forced, off x86, or where the kernel does not serve the head
    size."""
    model = tiny_model("llama", "sdpa")

    def plan(host: Host, **settings):  # auto's rules, whatever the environment forces
        return select(model, settings_with(**{"cpu_kernels": "auto", **settings}), host)

    def with_kernel(host: Host, works: bool) -> Host:
        return Host(host.machine, host.capability, host.vendor, host.threads, onednn=host.onednn,
                    openblas=host.openblas, tiled_kernel=host.tiled_kernel, block_kernel=host.block_kernel,
                    attention_kernel=lambda dim: works, free_memory=host.free_memory)

    avx2 = kind("AVX2", "AMD", 1)
    chosen = plan(with_kernel(avx2, True))
    assert chosen.fused_attention and "attention on mdcli's kernel" in chosen.describe()
    assert not plan(with_kernel(avx2, False)).fused_attention
    assert not plan(with_kernel(avx2, True), cpu_kernels="torch").fused_attention
    assert plan(with_kernel(kind("AVX512", "AMD", 1), True)).fused_attention
    assert plan(with_kernel(kind("AVX512", "AMD", 2), True)).fused_attention
    assert not plan(with_kernel(kind("AVX512", "Intel", 2), True)).fused_attention
    assert not plan(with_kernel(kind("AVX512", "Intel", 1), True)).fused_attention
    assert not plan(with_kernel(kind("DEFAULT", "", 1, machine="aarch64"), True)).fused_attention


@needs_kernel
@pytest.mark.parametrize("arch", SUPPORTED)
def test_a_forest_on_the_kernel_decodes_transformers_tokens_and_logits(arch):
    """Dense attention on the kernel for every step of a few branches (whatever this host's plan
    says), sliding windows and mixed layer types included: transformers' logits within 1e-4 and
    its greedy tokens, step by step, through a branch finishing and the cache compacting."""
    model = model_for(arch)
    prompts = random_prompts(45, [6, 2, 11, 4, 8], seed=5)
    worst, _ = lockstep_logits(model, prompts, steps=12, drop_at=5, fused_attention=True,
                               settings=settings_with(sparse_attention="off"))
    assert worst < 1e-4, f"max logit difference {worst:.2e}"


@needs_kernel
@pytest.mark.parametrize("arch", SUPPORTED)
def test_every_branch_on_the_kernel_gets_the_tokens_generate_gives_it_alone(arch):
    model = model_for(arch)
    engine = engine_on_kernel(model)
    prompts = random_prompts(50, [4, 4, 12, 2, 7], seed=3)
    generated = greedy_forest(engine, prompts, steps=12, drop_at=3)
    assert engine.model_forward.own.fused_forwards >= 12  # every step of the forest ran on the kernel
    for i, prompt in enumerate(prompts):
        assert generated[i] == generate_alone(model, prompt, len(generated[i])), f"branch {i}"


@needs_kernel
def test_many_questions_over_one_document_attend_on_the_kernel_not_the_cascade_and_match_generate():
    """24 branches over one document: where the kernel serves the step (1-64 queries), dense on it
    beats the one-product cascade (notebook/attention.md, "One kernel for a few queries'
    attention"), so the steps take the kernel; each branch gets `generate`'s tokens."""
    model = model_for("llama")
    g = torch.Generator().manual_seed(13)
    document = torch.randint(2, model.config.vocab_size, (120,), generator=g).tolist()
    prompts = [document + torch.randint(2, model.config.vocab_size, (2 + i % 5,), generator=g).tolist()
               for i in range(24)]
    engine = engine_for(model, settings=settings_with(sparse_attention="auto"))
    own = own_variant(engine, **{**BMM_ONLY, "fused_attention": True})
    generated = greedy_forest(engine, prompts, steps=5)
    # every decode step (24 queries) on the kernel; the prefix plan only in the questions' prefill,
    # whose forwards are wider than the kernel's 64 queries
    assert own.fused_forwards >= 4
    assert own.prefix_forwards < 4
    for i, prompt in enumerate(prompts):
        assert generated[i] == generate_alone(model, prompt, len(generated[i])), f"branch {i}"


@needs_kernel
def test_forwards_on_two_threads_keep_their_own_scores():
    """Each thread has its own scratch for the scores: two threads attending at once over caches
    of different sizes each get torch's answer."""
    import threading

    generator = torch.Generator().manual_seed(4)
    jobs = []
    for slots in (700, 1900):
        query = torch.randn(1, 9, 8, 64, generator=generator)
        keys, values = cache_views(3, slots, 64, generator)
        jobs.append((query, keys, values, torch_attention(query, keys, values, None, 0.125)))
    failures = []

    def run(query, keys, values, expected):
        for _ in range(40):
            got = fused.fused_attention(query, keys, values, None, 0.125, 3)
            if not torch.allclose(got, expected, rtol=1e-4, atol=2e-6):
                failures.append(keys.shape[2])
                return

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
