"""The attention core of a forest step on a GPU: which kernel reads a tree mask fastest, exactly.

Shapes of the random llama-1b (32 query heads, 8 key/value heads, head size 64), bf16, a 4,096-token
document in a 5,120-slot buffer (a static step attends over its whole buffer: mdcli.backends.graphs),
W queries each seeing the document and itself. Each core is captured as a CUDA graph and its replays
timed with events (median of 5 x 50); its error is against float32 attention over the allowed keys.

* bmm: what mdcli's captured step runs (mdcli.backends.graphs.CAPTURED_CORE): per key/value group,
  one batched product for the scores with the mask added, a softmax, one for the weighted sum;
* sdpa: torch's entry with the mask (flash, memory-efficient or math, cuDNN left out:
  mdcli.backends.attention.cuda), grouped heads read natively (enable_gqa);
* efficient: the memory-efficient kernel alone, keys and values repeated to every query head;
* flash, lone query: flash attention over exactly the 4,097 keys it sees, no mask (one branch only);
* flex (with --flex): FlexAttention with a block mask made from the same tree (compiled on first
  use; the compile time is printed).

    python3 benchmarks/gpu/attention_cores.py [--flex]      # on a CUDA machine
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mdcli.backends.llama import _grouped_attention

HEADS, GROUPS, DIM, DOCUMENT, CAPACITY = 32, 8, 64, 4096, 5120
dev, dtype = "cuda", torch.bfloat16


def timed(fn) -> float:
    """Median microseconds of one replay of `fn` captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1000 / 50)
    return statistics.median(runs)


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| queries | core | us per layer | max error |")
    print("| ---: | --- | ---: | ---: |")
    for width in (1, 16, 64):
        query = torch.randn(1, HEADS, width, DIM, device=dev, dtype=dtype)
        keys = torch.randn(1, GROUPS, CAPACITY, DIM, device=dev, dtype=dtype)
        values = torch.randn(1, GROUPS, CAPACITY, DIM, device=dev, dtype=dtype)
        allowed = torch.zeros(width, CAPACITY, dtype=torch.bool, device=dev)
        allowed[:, :DOCUMENT] = True
        allowed[torch.arange(width), DOCUMENT + torch.arange(width)] = True
        mask = torch.zeros(width, CAPACITY, dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)
        mask = mask[None, None]
        repeat = HEADS // GROUPS
        wide_k, wide_v = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
        scores = (query.float() @ wide_k.float().transpose(-1, -2)) / DIM**0.5
        reference = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ wide_v.float()
        out = {}

        def sdpa():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                out["o"] = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)

        def efficient():
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                out["o"] = F.scaled_dot_product_attention(query, wide_k, wide_v, attn_mask=mask)

        rows = mask[0, 0].repeat(repeat, 1)  # [H/G * W, capacity]: made once per step, not per layer

        def bmm():
            out["o"] = _grouped_attention(query, keys, values, rows, DIM**-0.5, GROUPS).view(1, width, HEADS, DIM)
            out["o"] = out["o"].transpose(1, 2)

        cores = {"bmm (captured step's)": bmm, "sdpa, mask, grouped heads": sdpa, "efficient, heads repeated": efficient}
        if width == 1:
            seen_k, seen_v = wide_k[:, :, : DOCUMENT + 1], wide_v[:, :, : DOCUMENT + 1]

            def flash():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    out["o"] = F.scaled_dot_product_attention(query, seen_k, seen_v)

            cores["flash, lone query, no mask"] = flash
        for name, core in cores.items():
            try:
                micro = timed(core)
                error = float((out["o"].float() - reference).abs().max())
                print(f"| {width} | {name} | {micro:.1f} | {error:.1e} |", flush=True)
            except RuntimeError as exc:
                print(f"| {width} | {name} | failed: {str(exc).splitlines()[0][:80]} | |", flush=True)
        if "--flex" not in sys.argv:
            continue
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            started = time.perf_counter()
            block = create_block_mask(lambda b, h, q, k: allowed[q, k], None, None, width, CAPACITY, device=dev)
            compiled = torch.compile(flex_attention)
            out["o"] = compiled(query, keys, values, block_mask=block, enable_gqa=True)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - started
            micro = timed(lambda: out.__setitem__("o", compiled(query, keys, values, block_mask=block, enable_gqa=True)))
            error = float((out["o"].float() - reference).abs().max())
            print(f"| {width} | flex, block mask (compiled in {compile_s:.1f} s) | {micro:.1f} | {error:.1e} |", flush=True)
        except Exception as exc:  # noqa: BLE001 - a measurement: say what failed and go on
            print(f"| {width} | flex | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]} | |", flush=True)


if __name__ == "__main__":
    main()
