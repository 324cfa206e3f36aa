"""Benchmark: one decode step, mdcli's engine against transformers' own single-sequence step.

    python -m mdcli.bench.step                 # ratios: 1 and 8 branches over the bench's document
    python -m mdcli.bench.step --profile       # where a step's time goes, by part of the model
    python -m mdcli.bench.step --cpu-weights int8   # also the engine over int8 weights
    python -m mdcli.bench.step --device cuda   # the same steps on a GPU (no --profile there)

It steps on the CPU, one thread, unless --device says otherwise (on a machine with a GPU, `auto`
would load there), and its first line names the CPU and the device the steps ran on.

Every width's steps and the reference's are taken in turn, one of each, so the widths compare within
one run. The reference is what `generate` does per token, with the loop reduced to its core: the prompt
prefilled into a stock `DynamicCache`, then one token per forward on torch's own kernels, greedy.
The engine steps are mdcli's `Engine.forward` with 1 or B chains of one token each over the shared
cache of the same prompts (the bench's document plus questions, `mdcli.bench.ask.prompts_for`);
with `--guesses G` each branch feeds a chain of 1 + G tokens through the tree mask a speculative
step verifies its guesses with, against the same single-token reference.

The profile times parts by wrapping them (module hooks on linears, norms, attention blocks and
MLPs; the rotary, attention-kernel and cache-write functions): the wrapping costs a little, so the
parts add up to slightly more than an unwrapped step, and "Python glue" is the step minus the parts.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mdcli.backends import llama
from mdcli.backends import reference
from mdcli.backends.attention import fused, prefix
from mdcli.backends.host import cpu_line, device_line
from mdcli.backends.weights import gguf_blocks
from mdcli.backends.weights import packed as packing
from mdcli.backends.weights import tiled as tiled_gemm
from mdcli.backends.weights.blas import one_blas_thread, openblas_linear
from mdcli.backends.weights.int8 import dequantized_product, kernel_product, quantize
from mdcli.backends.weights.packed import (
    pack,
    packed_linear,
    transpose,
    transposed_linear,
)
from mdcli.bench import RANDOM_SHAPES
from mdcli.bench.ask import Case, int8_copy, prompts_for, step_weight_bytes
from mdcli.bench.harness import random_model
from mdcli.bench.kernels import median_seconds
from mdcli.bench.steppers import (
    EngineStepper,
    ReferenceStepper,
    median_step_seconds,
    memory_read_gbps,
)
from mdcli.core import cache as kv
from mdcli.core import engine as engine_module
from mdcli.errors import UsageError
from mdcli.models.load import load_model, resolve_device

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel

__all__ = ["EngineStepper", "ReferenceStepper", "StepProfile", "median_step_seconds", "memory_read_gbps"]


# -- profile ---------------------------------------------------------------------------------------


class StepProfile:
    """Seconds per part of the model, summed over the observed steps, for either forward.

    Each part is timed where both forwards reach it: `F.linear` and the oneDNN route (mdcli.backends.reference),
    the attention functions, the norm and activation modules or mdcli's norm function, the rotary
    table (and mdcli's application of it), the cache's `update` and the engine's mask. Every part is exclusive
    (attention inside attention counts once); the rest of the step is Python and dispatch glue."""

    PARTS = ("linears", "lm_head", "attention", "rotary", "norms", "activation", "cache writes", "mask")

    def __init__(self, lm: LoadedModel, parts: tuple[str, ...] | None = None) -> None:
        """parts: time only these (the rest counts as glue). A partial profile wraps only its parts'
        functions (by name) and modules (hooks), and enters no torch function mode, which dispatches
        every torch call through Python and lengthens the step it times several times more than
        wrapping products and attention alone (benchmarks/results/branch-step-zen3-floors.md).
        mdcli's forward reaches its products and
        attention by name (`block_linear` on the .gguf blocks, the kernel's or the cores' attention);
        transformers' forward, whose products are `F.linear`, needs the full profile."""
        unknown = set(parts or ()) - set(self.PARTS)
        if unknown:
            raise ValueError(f"no part {sorted(unknown)[0]!r} to profile: choose from {', '.join(self.PARTS)}")
        self.lm = lm
        self.parts = tuple(parts) if parts else self.PARTS
        self.whole = parts is None
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.total = 0.0
        self._depth: dict[str, int] = defaultdict(int)
        self._started: dict[object, float] = {}  # module -> when its call began (hooks), kept here, not on it

    @contextmanager
    def observe(self):
        with self._wrapped():
            started = time.perf_counter()
            yield
            self.total += time.perf_counter() - started
        self.steps += 1

    def table(self) -> list[tuple[str, float]]:
        """(part, ms per step) for every part, the glue, and the whole (wrapped) step."""
        rows = [(part, 1000 * self.seconds[part] / self.steps) for part in self.parts]
        total = 1000 * self.total / self.steps
        return [*rows, ("Python and dispatch glue (the rest)", total - sum(ms for _, ms in rows)), ("step", total)]

    @contextmanager
    def _wrapped(self):
        vocab = self.lm.model.config.vocab_size
        linear = F.linear

        def timed_linear_of(function, out_dim: int):
            """`function` timed as the head when its weight's output side (dim `out_dim`: 0 for
            [out, in] weights, 1 for transposed [in, out] copies) is the vocabulary, else linears."""
            def timed(x, weight, bias=None, **options):
                part = "lm_head" if weight.shape[out_dim] == vocab else "linears"
                return self._timed(function, part)(x, weight, bias, **options)
            return timed

        timed_linear = timed_linear_of(linear, 0)
        # the kernels the own forward's weight formats call by name (mdcli.backends.llama.WeightFormat)
        timed_packed_linear = timed_linear_of(packing.packed_linear, 0)
        timed_pair_padded_linear = timed_linear_of(packing.pair_padded_linear, 0)
        timed_transposed_linear = timed_linear_of(packing.transposed_linear, 1)
        timed_blas_linear = timed_linear_of(llama.openblas_linear, 1)
        timed_tiled_linear = timed_linear_of(llama.tiled_linear, 0)  # TiledWeight.shape is (out, in)
        timed_block_linear = timed_linear_of(llama.block_linear, 0)  # BlockWeight.shape is (out, in)

        timed_attention = self._timed(F.scaled_dot_product_attention, "attention")
        # mdcli's own functions are timed by name in their modules, each patch with the parts it times;
        # torch's F.linear and sdpa by a torch function mode over the step (torch itself is never patched)
        products, attention = ("linears", "lm_head"), ("attention",)
        patches = [
            (llama, "routed_linear", timed_linear_of(llama.routed_linear, 0), products),
            (llama, "sdpa_attention", self._timed(llama.sdpa_attention, "attention"), attention),
            (reference, "routed_linear", timed_linear_of(reference.routed_linear, 0), products),
            (reference, "gemm_attention", self._timed(reference.gemm_attention, "attention"), attention),
            (engine_module.Engine, "_additive", self._timed(engine_module.Engine._additive, "mask"), ("mask",)),
            (kv.GrowingLayer, "update", self._timed(kv.GrowingLayer.update, "cache writes"),
             ("cache writes",)),
            (llama, "_rms_norm", self._timed(llama._rms_norm, "norms"), ("norms",)),
            (llama, "_rotate", self._timed(llama._rotate, "rotary"), ("rotary",)),
            (packing, "packed_linear", timed_packed_linear, products),
            (packing, "pair_padded_linear", timed_pair_padded_linear, products),
            (packing, "transposed_linear", timed_transposed_linear, products),
            (llama, "openblas_linear", timed_blas_linear, products),
            (llama, "tiled_linear", timed_tiled_linear, products),
            (llama, "block_linear", timed_block_linear, products),
            (llama, "_grouped_attention", self._timed(llama._grouped_attention, "attention"), attention),
            (fused, "fused_attention", self._timed(fused.fused_attention, "attention"), attention),
            (prefix.PrefixPlan, "attend", self._timed(prefix.PrefixPlan.attend, "attention"), attention),
        ]
        patches = [(owner, attr, replacement) for owner, attr, replacement, parts in patches
                   if set(parts) & set(self.parts)]
        handles = []
        for name, module in self.lm.model.named_modules():
            part = _part_of(name)
            if part is not None and part in self.parts:
                handles.append(module.register_forward_pre_hook(self._start(part)))
                handles.append(module.register_forward_hook(self._stop(part)))
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
        try:
            for owner, attr, replacement in patches:
                setattr(owner, attr, replacement)
            with (_TimedTorchFunctions({F.linear: timed_linear, F.scaled_dot_product_attention: timed_attention})
                  if self.whole else nullcontext()):
                yield
        finally:
            for owner, attr, original in reversed(saved):
                setattr(owner, attr, original)
            for handle in handles:
                handle.remove()

    def _timed(self, function, part):
        def timed(*args, **kwargs):
            self._depth[part] += 1
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth[part] -= 1
                if self._depth[part] == 0:
                    self.seconds[part] += time.perf_counter() - started
        return timed

    def _start(self, part):
        def hook(module, args):
            self._started[module] = time.perf_counter()
        return hook

    def _stop(self, part):
        def hook(module, args, output):
            self.seconds[part] += time.perf_counter() - self._started.pop(module)
        return hook


class _TimedTorchFunctions(TorchFunctionMode):
    """While entered, in this thread: each torch function in `timed` runs through its timed wrapper."""

    def __init__(self, timed: dict) -> None:
        super().__init__()
        self.timed = timed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.timed.get(func, func)(*args, **(kwargs or {}))


def _part_of(name: str) -> str | None:
    """The part a module's whole call belongs to (its linears are timed through F.linear)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("norm") or leaf.endswith("layernorm"):
        return "norms"
    if leaf == "rotary_emb":
        return "rotary"
    if leaf == "act_fn":
        return "activation"
    return None


# -- linear kernels --------------------------------------------------------------------------------


def linear_kernels_table(token_counts: list[int], repeats: int = 7, int8_weights: bool = False) -> str:
    """The fused projections of the embedded model's shape (30 x qkv, o, gate_up, down, plus the
    output head), random float32 weights, one pass of M tokens: torch's `F.linear`, oneDNN on the
    plain weights, oneDNN on packed weights (mdcli.backends.weights.packed), torch (MKL) and OpenBLAS on transposed
    copies (mdcli.backends.weights.packed.transpose, mdcli.backends.weights.blas; OpenBLAS on one thread), mdcli's tiled
    kernel (mdcli.backends.weights.tiled) and its block kernel (mdcli.backends.weights.gguf_blocks, over the weights rounded to
    the embedded model's Q4_1 / Q8_0 blocks) where they build; with int8_weights also the int8 kernel and the
    dequantized product `--cpu-weights int8` chooses between (mdcli.backends.weights.int8; "best vs stock"
    then counts them too). Median ms over `repeats`."""
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(*shape, generator=generator) * 0.02 for shape in shapes]
    packed = [pack(w) for w in weights]
    transposed = [transpose(w) for w in weights]

    def onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    kernels = [(F.linear, weights), (onednn, weights), (packed_linear, packed), (transposed_linear, transposed),
               (openblas_linear, transposed)]
    names = ["stock `F.linear`", "oneDNN", "oneDNN packed", "MKL transposed", "OpenBLAS transposed"]
    if tiled_gemm.tiled_works():  # mdcli's own kernel, where it builds
        kernels.append((tiled_gemm.tiled_linear, [tiled_gemm.tile(w) for w in weights]))
        names.append("mdcli tiled")
    if gguf_blocks.blocks_work():  # the embedded model's .gguf layout: Q4_1 projections, a Q8_0 head
        kernels.append((gguf_blocks.block_linear, [gguf_blocks.rounded_to(w.numpy(), "Q8_0" if w.shape[0] == 49152
                                                                          else "Q4_1") for w in weights]))
        names.append("gguf blocks")
    if int8_weights:  # --cpu-weights int8's two products (mdcli.backends.weights.int8), bf16 activations
        quantized = [quantize(w) for w in weights]
        kernels += [(lambda x, w: kernel_product(x.to(torch.bfloat16), w), quantized),
                    (lambda x, w: dequantized_product(x.to(torch.bfloat16), w), quantized)]
        names += ["int8 kernel", "int8 dequantized"]
    lines = ["| M tokens | " + " | ".join(f"{name}, ms" for name in names) + " | best vs stock |",
             "|---:|" + "---:|" * (len(names) + 1)]
    with torch.inference_mode(), one_blas_thread():
        for m in token_counts:
            inputs = {k: torch.randn(m, k, generator=generator) for k in (576, 1536)}
            timings = []
            for function, mats in kernels:
                def one_pass(function=function, mats=mats):
                    for (_, k), w in zip(shapes, mats):
                        function(inputs[k], w)
                timings.append(1000 * median_seconds(one_pass, repeats))
            cells = " | ".join(f"{ms:.1f}" for ms in timings)
            lines.append(f"| {m} | {cells} | {timings[0] / min(timings):.2f}x |")
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--branches", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--guesses", type=int, default=0,
                        help="each branch's step also verifies this many guessed tokens (a speculative step)")
    parser.add_argument("--profile", action="store_true", help="time the parts of each engine step")
    parser.add_argument("--forwards", default="transformers,mdcli",
                        help="engine forwards to compare: transformers, mdcli, mdcli+fused (attention on the kernel), "
                             "mdcli-python (a step's layers in Python, not in one native call), "
                             "mdcli:bmm|transformers:plain|packed|transposed|openblas|padded|ahead|tiled|blocks|packed+openblas ...")
    parser.add_argument("--linears", action="store_true", help="only the linear-kernel table (no model)")
    parser.add_argument("--cpu-weights", choices=("float32", "int8"), default="float32",
                        help="int8: also step the engine over int8 weights (mdcli.backends.weights.int8; a copy of the "
                             "model, quantized), against the same float32 reference")
    parser.add_argument("--device", default="cpu",
                        help="where the model steps: cpu (default, one thread), cuda, cuda:N or auto")
    parser.add_argument("--random-model", metavar="SHAPE",
                        help=f"random weights of a named shape instead of the embedded model: {', '.join(RANDOM_SHAPES)}")
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except UsageError as exc:
        parser.error(str(exc))
    if args.profile and device.type != "cpu":
        # its wrappers time each part's launch, not its work, on an asynchronous device
        parser.error("--profile times the parts of a CPU step: drop --profile or use --device cpu")
    torch.set_num_threads(1)
    if args.linears:
        int8 = args.cpu_weights == "int8"  # and where its two products cross over
        print(linear_kernels_table([1, 2, 4, 8, 16, 32, 64, 512] if int8 else [1, 2, 4, 8, 16, 64], int8_weights=int8))
        return
    lm = random_model(args.random_model, device=str(device)) if args.random_model else load_model(
        device=str(device), quiet=True)
    int8 = int8_copy(lm) if args.cpu_weights == "int8" else None
    widths = [int(b) for b in args.branches.split(",")]
    prompts = prompts_for(lm, Case(max(widths), args.context, args.steps))
    print(f"host: {cpu_line()}; steps on {device_line(lm.device)}")
    print(f"one thread reads {memory_read_gbps():.1f} GB/s; a step reads {step_weight_bytes(lm) / 1e6:.0f} MB of "
          f"weights; prompt {len(prompts[0])} tokens")
    # every width's steps and the reference's taken in turn, so that a drift in the machine's speed
    # falls on all of them: the widths' ratio (8 branches against 1) is read within one run
    steppers = {(0, "reference"): ReferenceStepper(lm, prompts[0])}
    for width in widths:
        steppers |= {(width, f"{f} forward"): EngineStepper(lm, prompts[:width], f, args.guesses)
                     for f in args.forwards.split(",")}
        if int8 is not None:
            steppers |= {(width, f"int8 weights, {f} forward"): EngineStepper(int8, prompts[:width], f, args.guesses)
                         for f in args.forwards.split(",")}
    medians = median_step_seconds(steppers, args.steps)
    reference = medians[(0, "reference")]
    print(f"reference (one sequence, transformers' own step): {1000 * reference:.1f} ms")
    for width in widths:
        for (of, name), seconds in medians.items():
            if of == width:
                against = "" if width == widths[0] else (
                    f", {seconds / medians[(widths[0], name)]:.2f}x its {widths[0]}-branch step")
                print(f"{width} branch(es), {name}: {1000 * seconds:.1f} ms = {seconds / reference:.2f}x the reference"
                      f"{against}")
    if not args.profile:
        return
    for width in widths:
        for forward in args.forwards.split(","):
            profile = StepProfile(lm)
            median_step_seconds({"engine": EngineStepper(lm, prompts[:width], forward, args.guesses)}, args.steps,
                                observe=profile.observe)
            print(f"\n| part of a {width}-branch step, {forward} forward | ms | share |\n|---|---:|---:|")
            rows = profile.table()
            for part, ms in rows:
                print(f"| {part} | {ms:.2f} | {100 * ms / rows[-1][1]:.0f}% |")
            print()


if __name__ == "__main__":
    main()
