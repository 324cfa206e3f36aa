"""The selector: host facts, settings and a model in, a `Plan` out, once, at load.

The plan says which forward runs (mdcli's own for the Llama family, else transformers'), which
kernels its linears and attention use, which weight copies serve which forward widths, and why.
The engine is handed the forward built from it (mdcli.backends.forward); the `start` event, the
run header under --verbose and `mdcli info` print its description. Nothing asks again later.

The rules (docs/cpu-backends.md lists them as a table; each holds on the host kind it was
measured on):

* float32 CPU linears and masked attention run on oneDNN on x86-64 with AVX-512, on torch's own
  kernels elsewhere (`linear_kernels`; notebook/cpu-kernels.md, "Kernels: which matrix multiply
  mdcli's forwards use");
* mdcli's own forward attends with two batched products per key/value group where linears run on
  oneDNN or on an AVX2-only x86-64 CPU, through sdpa elsewhere and past `bmm_max_queries`; on
  AMD's x86-64 hosts (AVX2-only Zen 3, AVX-512 Zen 5) a dense forward of 1 to 64 queries attends on
  mdcli's own kernel where it builds and serves the head size (`fused_attention`;
  notebook/attention.md, "One kernel for a few queries' attention");
* a packed oneDNN copy of the weights serves wide forwards on those same hosts
  (notebook/cpu-kernels.md, "A faster decode step");
* a transposed copy serves a lone token on AVX2-only hosts and, with torch on one thread, on
  OpenBLAS (notebook/cpu-kernels.md, "A lone token on OpenBLAS");
* a tiled copy serves forwards of a few tokens on AVX2-only hosts with torch on one thread
  (notebook/cpu-kernels.md, "Small products on Zen 3: mdcli's own kernel");
* every copy only if it fits in half the free memory;
* the model's own .gguf blocks serve forwards of up to `block_rows` tokens (16) where its float32
  weights are exactly them and the block kernel works here, and then no transposed copy is made
  (notebook/gguf-blocks.md, "One rebuild for every row");
* where they serve every width, the block kernel multiplies up to `block_kernel_rows` tokens (64
  with torch on one AVX2 thread, else 16) (notebook/gguf-blocks.md, "The kernel past 16 rows on one
  thread"), and wider forwards on its own GEMM on AMD's AVX-512 cores (`block_gemm`;
  notebook/gguf-blocks.md, "A prefill on the kernel's own GEMM"), else tile by tile on torch's GEMM;
* where a step's products run on the blocks' narrow kernel and its attention on mdcli's kernel, its
  layers run in one native call (`native_step`; notebook/gguf-blocks.md, "A step's layers in one
  call");
* two-token products are padded to four rows on AMD cores with AVX-512 (notebook/cpu-kernels.md,
  "Two-token forwards");
* the cached keys and values are read ahead of a wide forward's products on AMD cores
  (notebook/attention.md, "Reading the cache ahead").
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from mdcli import settings as settings_module
from mdcli.backends import graphs
from mdcli.backends.attention import fused
from mdcli.backends.attention.gemm import onednn_linear_works
from mdcli.backends.attention.sparse import GATHER_COST, GATHER_COST_AVX512
from mdcli.backends.forward_support import unsupported_reason
from mdcli.backends.native_step import builds as native_step_builds
from mdcli.backends.host import available_memory_bytes, cpu_capability, cpu_vendor
from mdcli.backends.weights import gguf_blocks, gguf_reading
from mdcli.backends.weights import tiled as tiled_gemm
from mdcli.backends.weights.blas import openblas_works
from mdcli.backends.weights.int8 import has_int8_weights
from mdcli.settings import Settings

# Forwards of more queries than this attend with sdpa on the bmm core's hosts, because bmm
# materializes every score: the width past which sdpa measured faster, on each host kind.
BMM_MAX_QUERIES = 64  # AVX2-only x86-64 (notebook/cpu-kernels.md, "Zen 3 (AVX2), measured on the real host kind")
BMM_MAX_QUERIES_AVX512 = 32  # oneDNN linears (notebook/attention.md, "Long forwards over a tree: sdpa past 32 queries")
# Where a lone token's products run on OpenBLAS, forwards of up to this many tokens also take its
# weighted sum of the cached values, as far as that measured faster than the forward's own attention.
SMALL_BLAS_QUERIES = 3  # AVX-512 (notebook/speculation.md, "Several branches: guess only where it shortens the run")
SMALL_BLAS_QUERIES_AVX2 = 1  # the lone token alone (notebook/cpu-kernels.md, "Zen 3 again: OpenBLAS, reading ahead")


@dataclass(frozen=True)
class Host:
    """What the selector reads about the machine. The probes that build or run a kernel are
    functions, called only where a rule gets that far."""

    machine: str  # platform.machine(): "x86_64", "aarch64", ...
    capability: str  # the ISA torch's CPU kernels dispatch to: "AVX512", "AVX2", "DEFAULT", ...
    vendor: str  # "AMD", "Intel" or ""
    threads: int  # torch's intra-op threads
    onednn: Callable[[], bool] = onednn_linear_works
    openblas: Callable[[], bool] = openblas_works
    tiled_kernel: Callable[[], bool] = tiled_gemm.tiled_works
    block_kernel: Callable[[], bool] = gguf_blocks.blocks_work
    attention_kernel: Callable[[int], bool] = fused.fused_serves  # head size -> the fused kernel serves it
    free_memory: Callable[[torch.device], int | None] = available_memory_bytes
    step_kernel: Callable[[], bool] = native_step_builds

    @classmethod
    def read(cls) -> Host:
        return cls(platform.machine().lower(), cpu_capability(), cpu_vendor(), torch.get_num_threads())

    @property
    def x86(self) -> bool:
        return self.machine in {"x86_64", "amd64"}

    @property
    def measured_isa(self) -> bool:
        """AVX-512 or AVX2: the two host kinds the step rules were measured on."""
        return "AVX512" in self.capability or self.capability == "AVX2"


@dataclass(frozen=True)
class KernelChoice:
    """Which kernels float32 CPU linears and attention use, and why."""

    name: str  # "oneDNN" | "torch"
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


@dataclass(frozen=True)
class Plan:
    """How every forward of one model runs on this host. Built by `select`, read by the forward."""

    device: str
    dtype: str
    own_forward: bool  # mdcli's own forward (mdcli.backends.llama) for masked forwards and lone tokens
    own_forward_reason: str  # why not, where it is not used
    linears: KernelChoice
    attention: str  # own forward's core: "bmm" (batched products per group) or "sdpa"
    bmm_max_queries: int | None  # wider forwards attend with sdpa
    fused_attention: bool  # dense forwards of 1 to fused.FUSED_MAX_QUERIES queries on the bmm core run on mdcli's attention kernel
    packed: bool  # a oneDNN-packed copy serves forwards the narrower copies do not
    pair_padding: bool  # two-row products on a packed copy run as four rows (AMD with AVX-512)
    transposed: bool  # a transposed copy serves a lone token
    lone_blas: bool  # a lone token's products run on OpenBLAS where a transposed copy serves it
    avx2_only: bool  # an x86-64 host with AVX2 and no AVX-512, whose rules hold (torch's linears, bmm attention, packed copies)
    tiled: bool  # a tiled copy serves forwards of up to tiled_rows tokens (mdcli's AVX2 kernel)
    tiled_rows: int
    blocks: str | None  # the .gguf block kinds serving forwards of up to block_rows tokens, e.g. "Q4_1/Q8_0"
    blocks_reason: str | None  # why the blocks were looked for and not used
    blocks_held: str  # what each matrix is held as, by type name ("q/k/v Q4_K or Q4_K+Q6_K, ..., head Q6_K"; "" without blocks)
    block_rows: int
    block_kernel_rows: int  # forwards on the blocks of up to this many tokens take the block kernel, wider ones its GEMM or tiles
    block_gemm: bool  # forwards on the blocks wider than block_kernel_rows take the kernel's own GEMM, not tiles and the float32 GEMM
    on_blocks: bool  # every forward multiplies by the blocks: the model holds no float32 projections or head
    float32_reason: str  # why a .gguf's float32 weights were loaded all the same ("" where they were not, or no .gguf)
    blas_queries: int  # forwards of up to this many tokens take OpenBLAS's weighted sum of the values, where
    # a lone token's products run on OpenBLAS or on a narrower copy (tiled, blocks): 1 on AVX2-only hosts
    read_ahead: bool  # wide forwards read the cached keys and values before multiplying by them
    gather_cost: float  # a gathered cache slot in query rows (sparse attention's rule)
    sparse_attention: str  # "auto" | "off" | "always" | "prefix"
    cudnn_attention: bool  # CUDA forwards may use cuDNN's attention
    native_step: bool = False  # a step of up to block_kernel_rows tokens runs its layers in one native call (mdcli.backends.native_step)
    static_step: bool = False  # forwards of up to 64 tokens run on static buffers, padded to a bucket (mdcli.backends.graphs)
    cuda_graphs: bool = False  # ... each bucket's captured once as a CUDA graph and replayed
    graphs_reason: str = ""  # why not, where they are not
    static_core: str | None = None  # the attention core of a static step ("bmm"; None: the own forward's own choice)
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        """One line: the kernels and why, as the `start` event's `kernels` field and --verbose show it."""
        return str(KernelChoice(self.linears.name, "; ".join([self.linears.reason, *self.notes])))

    def as_dict(self) -> dict:
        return asdict(self) | {"description": self.describe()}


def select(model, settings: Settings | None = None, host: Host | None = None, *,
           float32_reason: str | None = None) -> Plan:
    """The plan for `model` (a loaded transformers model) on this host under `settings` (default:
    the environment's); float32_reason: why the loader kept a .gguf's float32 weights, if it did
    (mdcli.models.on_blocks)."""
    settings = settings or settings_module.current()
    host = host or Host.read()
    on_blocks = gguf_blocks.on_blocks_only(model)
    device, dtype = (torch.device("cpu"), torch.float32) if on_blocks else weight_kind(model)
    linears = linear_kernels(device, dtype, settings, host)
    onednn = linears.name == "oneDNN"
    auto_x86 = device.type == "cpu" and dtype == torch.float32 and settings.cpu_kernels == "auto" and host.x86
    avx2_only = auto_x86 and host.capability == "AVX2" and host.onednn()
    lone_blas_host = auto_x86 and host.threads == 1 and host.measured_isa and host.onednn() and host.openblas()
    tiled_host = _tiled_host(device, dtype, settings, host, avx2_only)
    own_reason = "MDCLI_FORWARD=transformers" if settings.forward == "transformers" else unsupported_reason(model)
    copies = own_reason is None and not has_int8_weights(model) and settings.packed_weights and not on_blocks
    fits = _fits(model, host)
    packed = copies and (onednn or avx2_only) and fits(1)
    tiled = copies and tiled_host and fits(2 if packed else 1)
    blocks, blocks_reason, blocks_held = _blocks(model, device, dtype, settings, host, own_reason)
    transposed = blocks is None and copies and (avx2_only or lone_blas_host) and fits(1 + packed + tiled)
    block_kernel_rows = gguf_blocks.kernel_rows(host.threads, host.capability)
    # measured against the tiles and oneDNN's GEMM on a Zen 5 core, AVX-512 (notebook/gguf-blocks.md,
    # "A prefill on the kernel's own GEMM"): AMD's AVX-512 hosts alone (an Intel core's oneDNN, with
    # its AMX, unmeasured against it); the AVX2 and plain builds have no such GEMM
    block_gemm = bool(blocks) and auto_x86 and host.vendor == "AMD" and host.capability == "AVX512" \
        and gguf_blocks.gemm_serves(host.threads)
    notes = [_blocks_note(blocks, blocks_held, on_blocks, block_kernel_rows, block_gemm)] if blocks else []
    # measured faster than the bmm core on an AVX2-only Zen 3 core and on an AVX-512 Zen 5 core,
    # slower on an AVX-512 Xeon (whose 2 MB of L2 a core and 300 MB of L3 keep a step's keys and
    # values warm): AMD's x86-64 hosts alone (docs/performance.md, "The files users run")
    amd_x86 = auto_x86 and host.vendor == "AMD" and host.onednn() and host.capability in ("AVX2", "AVX512")
    fused_attention = own_reason is None and amd_x86 and host.attention_kernel(_head_dim(model))
    if fused_attention:
        notes.append(f"{fused.FUSED_MIN_QUERIES}-{fused.FUSED_MAX_QUERIES} queries' attention on mdcli's kernel")
    # a step's products on the blocks and its attention on the kernel: its layers in one call
    # (notebook/gguf-blocks.md, "A step's layers in one call"; measured on a Zen 4 core)
    native = fused_attention and bool(blocks) and host.step_kernel()
    if native:
        notes.append(f"1-{block_kernel_rows} tokens' layers in one native call")
    if transposed and lone_blas_host:
        notes.append("one thread: a lone token on OpenBLAS")
    if tiled:
        notes.append(f"2-{tiled_gemm.TILED_MAX_ROWS} tokens on mdcli's tiled kernel")
    static_step, cuda_graphs, graphs_reason = _static_step(model, device, settings, own_reason)
    if static_step:
        notes.append(f"1-{graphs.BUCKETS[-1]} tokens {'replayed as CUDA graphs' if cuda_graphs else 'on static buffers'}")
    return Plan(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        own_forward=own_reason is None,
        own_forward_reason=own_reason or "",
        linears=linears,
        attention="bmm" if onednn or avx2_only else "sdpa",
        bmm_max_queries=BMM_MAX_QUERIES if avx2_only else BMM_MAX_QUERIES_AVX512 if onednn else None,
        fused_attention=fused_attention,
        packed=packed,
        pair_padding=onednn and host.vendor == "AMD",
        transposed=transposed,
        lone_blas=lone_blas_host,
        avx2_only=avx2_only,
        tiled=tiled,
        tiled_rows=tiled_gemm.TILED_MAX_ROWS,
        blocks=blocks,
        blocks_reason=blocks_reason,
        blocks_held=blocks_held,
        block_rows=gguf_blocks.max_rows(),
        block_kernel_rows=block_kernel_rows,
        block_gemm=block_gemm,
        on_blocks=on_blocks,
        float32_reason=float32_reason or "",
        blas_queries=SMALL_BLAS_QUERIES_AVX2 if avx2_only else SMALL_BLAS_QUERIES,
        read_ahead=auto_x86 and host.measured_isa and host.vendor == "AMD",
        gather_cost=GATHER_COST_AVX512 if onednn else GATHER_COST,
        sparse_attention=settings.sparse_attention,
        cudnn_attention=settings.cudnn_attention,
        native_step=native,
        static_step=static_step,
        cuda_graphs=cuda_graphs,
        graphs_reason=graphs_reason,
        static_core=graphs.CAPTURED_CORE if cuda_graphs else None,
        notes=tuple(notes),
    )


def _static_step(model, device: torch.device, settings: Settings, own_reason: str | None) -> tuple[bool, bool, str]:
    """(forwards of a few tokens on static buffers, each bucket's captured as a CUDA graph, why not):
    captured on CUDA for mdcli's own forward (auto), on static buffers uncaptured on any device
    (static: the CPU suite's check of the logic), neither (off)."""
    name = settings_module.variable("cuda_graphs")
    if settings.cuda_graphs == "off":
        return False, False, f"{name}=off"
    if own_reason is not None:
        return False, False, f"transformers' forward ({own_reason})"
    if settings.cuda_graphs == "static":
        return True, False, f"{name}=static: static buffers, never captured"
    reason = graphs.capture_reason(model, device)
    return (False, False, reason) if reason else (True, True, "")


def _head_dim(model) -> int:
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _blocks_note(kinds: str, held: str, on_blocks: bool, kernel_rows: int, gemm: bool) -> str:
    """What the plan says of the blocks: `kinds` the block kinds ("Q4_K/Q6_K"), `held` what each matrix is held as."""
    digits = ""
    if gguf_blocks.reads_digits() and set(kinds.split("/")) & set(gguf_blocks.DIGIT_KINDS):
        digits = "; a lone token's K-quant products on x in 23-bit fixed point (MDCLI_BLOCK_DIGITS)"
    if on_blocks:
        wider = "wider on its own GEMM" if gemm else "wider tile by tile"
        return (f"every forward on the file's own weights ({held}), widened to float32 in the kernel, "
                f"never held in float32; the block kernel up to {kernel_rows} tokens, {wider}{digits}")
    return f"1-{gguf_blocks.max_rows()} tokens on the .gguf's own blocks ({held}), widened to float32 in the kernel{digits}"


def linear_kernels(device: torch.device, dtype: torch.dtype, settings: Settings, host: Host) -> KernelChoice:
    """oneDNN for float32 CPU linears and masked attention only where measured to win (x86-64 with
    AVX-512), unless MDCLI_CPU_KERNELS forces a side."""
    name = settings_module.variable("cpu_kernels")
    if device.type != "cpu" or dtype != torch.float32:
        return KernelChoice("torch", "not a float32 CPU model")
    if settings.cpu_kernels == "torch":
        return KernelChoice("torch", f"{name}=torch")
    if not host.onednn():
        return KernelChoice("torch", "no working oneDNN in this torch build")
    if settings.cpu_kernels == "onednn":
        return KernelChoice("oneDNN", f"forced by {name}=onednn")
    if not host.x86:
        return KernelChoice("torch", "not x86-64, where oneDNN was measured")
    if "AVX512" not in host.capability:
        return KernelChoice("torch", f"{host.capability} without AVX-512: oneDNN measured slower there")
    return KernelChoice("oneDNN", "AVX-512: measured faster there")


def weight_kind(model) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of the model's weights, what the rules decide by; int8 weights
    (mdcli.backends.weights.int8) count as float32: their activations and attention are."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    up = layers[0].mlp.up_proj if layers is not None and hasattr(layers[0], "mlp") else None
    weight = getattr(up, "weight", None) if up is not None else None
    if up is not None and weight is None and hasattr(up, "values"):
        return up.values.device, torch.float32
    if weight is None:
        weight = head if head is not None else next(p for p in model.parameters() if p.dtype.is_floating_point)
    return weight.device, weight.dtype


def _tiled_host(device, dtype, settings: Settings, host: Host, avx2_only: bool) -> bool:
    """mdcli's tiled kernel serves forwards of a few tokens: float32 on CPU, on an AVX2-only x86-64
    CPU with torch on one thread (auto), anywhere it runs (always), never (off)."""
    if settings.tiled_gemm == "off" or device.type != "cpu" or dtype != torch.float32:
        return False
    if settings.tiled_gemm == "auto" and not (avx2_only and host.threads == 1):
        return False
    return host.tiled_kernel()


def _blocks(model, device, dtype, settings: Settings, host: Host,
            own_reason: str | None) -> tuple[str | None, str | None, str]:
    """(the .gguf block kinds the own forward multiplies forwards of a few tokens by, or None; why
    not, where they were looked for; what each matrix is held as)."""
    if own_reason is not None or not settings.gguf_blocks or not gguf_blocks.source_known(model):
        return None, None, ""
    if has_int8_weights(model) or device.type != "cpu" or dtype != torch.float32:
        return None, None, ""
    if gguf_blocks.max_rows() == 0 or not host.block_kernel():
        return None, None, ""
    found = gguf_reading.model_blocks(model, host.free_memory)
    if isinstance(found, str):
        return None, found, ""
    layers, head = found
    kinds = {kind for weight in (*(w for layer in layers for w in layer), head) for kind in weight.kinds}
    return "/".join(sorted(kinds)), None, gguf_blocks.held_as(layers, head, gguf_blocks.embedding_blocks(model))


def _fits(model, host: Host) -> Callable[[int], bool]:
    """fits(n): n copies of the layers' and head's float32 weights fit in half the free memory."""
    def fits(copies: int) -> bool:
        weight = model.model.layers[0].mlp.up_proj.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return False
        needed = sum(p.numel() * p.element_size() for p in (*model.model.layers.parameters(), model.lm_head.weight))
        free = host.free_memory(weight.device)
        return free is not None and copies * needed <= free // 2

    return fits
