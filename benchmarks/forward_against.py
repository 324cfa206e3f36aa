"""A prefill on mdcli's forward as it is against the forward at an earlier commit, in one process.

    python benchmarks/forward_against.py -m MODELS/r1b-Q4_K_M.gguf --tokens 567 --threads 2 \\
        [--before HEAD] [--kernel-too] [--pieces-before N] [--rounds 6] [--keep last|none]

The forward at `--before` is mdcli/backends/llama.py as that commit has it (`git show`), imported
beside the working tree's and built over the same loaded model and plan, so only that file's changes
are compared (the kernels and everything else are the working tree's); with `--kernel-too` the
block kernel (mdcli/backends/native/gguf_blocks.c and the headers beside it) at that commit too,
built as mdcli builds its own and bound while the forward before runs; with `--pieces-before N`
the forward before takes a causal prefill in pieces of N tokens (the last one shorter), as
mdcli.backends.forward did before its pieces were of equal size. Each round runs the same
forward (a fresh cache, the first `--tokens` tokens of the README four times over) once each way,
the order reversed every other round; `--keep last` wants the last row's logits (a prompt's
prefill), `none` no logits (a shared document's). The process gets the command line's OpenMP and
allocator defaults (mdcli.settings.process_defaults). Prints the medians, their ratio (now / before)
each round's ratio and its median, and the largest logit difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mdcli import settings  # noqa: E402

settings.process_defaults()  # before torch: OpenMP reads its variables once

import torch  # noqa: E402

from mdcli import api  # noqa: E402
from mdcli.backends import forward as forward_module  # noqa: E402
from mdcli.backends.host import cpu_line  # noqa: E402
from mdcli.backends.native import build as native  # noqa: E402
from mdcli.backends.weights import gguf_blocks  # noqa: E402
from mdcli.core import cache as kv  # noqa: E402


def forward_class_at(revision: str):
    """FastForward from mdcli/backends/llama.py at `revision`, imported as its own module."""
    source = subprocess.run(["git", "show", f"{revision}:mdcli/backends/llama.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "llama_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("llama_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["llama_before"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module.FastForward


def kernel_at(revision: str):
    """The block kernel as `revision` has it, built and bound as mdcli.backends.weights.gguf_blocks binds its own."""
    folder, native_dir = Path(tempfile.mkdtemp()), "mdcli/backends/native/"
    listed = subprocess.run(["git", "ls-tree", "--name-only", revision, native_dir], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()
    for path in [native_dir + "gguf_blocks.c", *(p for p in listed if p.endswith(".h"))]:
        (folder / Path(path).name).write_bytes(subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO,
                                                              check=True, capture_output=True).stdout)
    lib = native.load_any(folder / "gguf_blocks.c", openmp=True)
    if lib is None:
        raise SystemExit(f"the block kernel at {revision} does not build here")
    return gguf_blocks.bound(lib)


@contextmanager
def way_bound(lib, pieces: int | None):
    """gguf_blocks.library() answers `lib` and a causal prefill takes pieces of `pieces` tokens
    inside (None: the working tree's, unchanged)."""
    own_library, own_pieces = gguf_blocks.library, forward_module.piece_size
    if lib is not None:
        gguf_blocks.library = lambda: lib
    if pieces is not None:
        forward_module.piece_size = lambda tokens: pieces
    try:
        yield
    finally:
        gguf_blocks.library, forward_module.piece_size = own_library, own_pieces


def timed(model_forward, own, tokens: torch.Tensor, keep: torch.Tensor | None) -> tuple[float, torch.Tensor | None]:
    """Seconds of one forward of `tokens` from an empty cache on `own`, and its logits."""
    model_forward.own = own
    started = time.perf_counter()
    logits = model_forward(tokens, torch.arange(len(tokens)), None, kv.new_cache(), keep)
    return time.perf_counter() - started, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--tokens", type=int, default=567)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--before", default="HEAD")
    parser.add_argument("--kernel-too", action="store_true", help="the block kernel at --before too")
    parser.add_argument("--pieces-before", type=int, default=None, help="the forward before's causal pieces, tokens")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--keep", choices=("last", "none"), default="last")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = api.load_model(api.LoadOptions(model=args.model, prompt_cache="off"))
    model_forward = lm.forward
    text = (REPO / "README.md").read_text() * 4
    tokens = torch.tensor(lm.tokenizer(text)["input_ids"][: args.tokens])
    keep = torch.tensor([len(tokens) - 1]) if args.keep == "last" else None
    ways = {"before": forward_class_at(args.before)(model_forward.model, model_forward.plan), "now": model_forward.own}
    kernels = {"before": kernel_at(args.before) if args.kernel_too else None, "now": None}
    pieces = {"before": args.pieces_before, "now": None}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    logits = {}
    with torch.inference_mode():
        for name, own in ways.items():  # warm
            with way_bound(kernels[name], pieces[name]):
                timed(model_forward, own, tokens, keep)
        for round_ in range(args.rounds):
            for name in ways if round_ % 2 == 0 else reversed(ways):
                with way_bound(kernels[name], pieces[name]):
                    took, logits[name] = timed(model_forward, ways[name], tokens, keep)
                seconds[name].append(took)
    print(f"{cpu_line()}; {args.model}, {len(tokens)} tokens, keep {args.keep}, {args.threads} thread(s), "
          f"{args.rounds} rounds (ABBA), before = {args.before}{' (its kernel too)' if args.kernel_too else ''}"
          f"{f', in pieces of {args.pieces_before}' if args.pieces_before else ''}")
    before = statistics.median(seconds["before"])
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"{name}: {median * 1e3:.0f} ms ({median / before:.3f}x), each {[round(t * 1e3) for t in times]}")
    pairs = [now / then for now, then in zip(seconds["now"], seconds["before"])]
    print(f"each round's ratio (now / before): {[round(r, 3) for r in pairs]}, median {statistics.median(pairs):.3f}")
    if keep is not None:
        print(f"largest logit difference: {float((logits['now'] - logits['before']).abs().max()):.2e}")


if __name__ == "__main__":
    main()
