"""Shared fixtures: the real embedded model loaded once per session, tiny saved models once per
architecture. Every test runs offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One thread, here and in the CLI subprocesses the tests start: on a shared 2-core machine two
# threads per process oversubscribe the cores and run 10-25x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The exactness checks compare float32 on CPU, also on a machine with a GPU (where --device auto
# would pick CUDA in bf16); the GPU tests name cuda themselves.
os.environ.setdefault("MDCLI_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped cleanly when no CUDA device exists."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def prompt_cache_folder(tmp_path_factory):
    """--prompt-cache auto (the command line's default) writes into a folder of this session's,
    never the user's: MDCLI_PROMPT_CACHE_DIR for this process and the CLI subprocesses it starts,
    restored afterwards. The rest of mdcli's cache folder (the embedded model's copy, the native
    kernels) stays where it is, so nothing is converted or compiled again."""
    folder = tmp_path_factory.mktemp("prompt-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MDCLI_PROMPT_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="session")
def embedded():
    """The real default model (SmolLM2-135M-Instruct, fp32, CPU), loaded once."""
    from mdcli.models.load import load_model

    return load_model(quiet=True)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(arch) -> folder holding a saved tiny random model of that architecture."""
    from tests.tiny_models import make_tiny_model

    made: dict[str, object] = {}

    def make(arch: str):
        if arch not in made:
            made[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return made[arch]

    return make


@pytest.fixture(scope="session")
def embedded_float32():
    """The real default model loaded with its float32 weights kept beside its .gguf blocks
    (LoadOptions.keep_float32): for the tests of the float32 kernels (packed, transposed, tiled,
    the blocks for a few tokens beside them). The default load holds no float32 weights."""
    from mdcli.models.load import LoadOptions, load_model

    return load_model(LoadOptions(quiet=True, keep_float32=True))
