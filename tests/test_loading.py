"""Loading: sources, device/dtype choices, refusals, the embedded model's converted cache.

No mocks: tiny random models are saved to folders and go through the real `load_model`. The
embedded model (conftest's session fixture `embedded`) uses the default mdcli cache, so its
one-time conversion (about 25 s) is paid once per machine, not per run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mdcli.models.architectures import check_exact_support, context_length, sliding_window_layout
from mdcli.models.embedded import EMBEDDED_NAME, cache_root, embedded_gguf_path, embedded_model_dir, gguf_sha256
from mdcli.errors import ModelLoadError, UnsupportedModelError, UsageError
from mdcli.models.load import eos_token_ids, load_model, resolve_device, resolve_dtype
from mdcli.core.cache import new_cache
from tests.reference import plain
from tests.tiny_models import TINY_ARCHS, TINY_SLIDING_WINDOW, make_refused_model, make_tiny_model

HAS_CUDA = torch.cuda.is_available()
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
no_cuda_only = pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on machines without CUDA")
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def assert_one_line(error: BaseException, *fragments: str) -> None:
    text = str(error)
    assert "\n" not in text and text.strip() == text
    for fragment in fragments:
        assert fragment in text, text


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> dict[str, Path]:
    """Every tiny architecture, saved once per session by conftest's `tiny_dir`."""
    return {arch: tiny_dir(arch) for arch in TINY_ARCHS}


def chat_ids(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt").input_ids


# --- the embedded model ---------------------------------------------------------------------


def test_embedded_model_loads_ready_for_inference(embedded):
    assert embedded.name == EMBEDDED_NAME
    assert (embedded.device.type, embedded.dtype, embedded.dtype_reason) == ("cpu", torch.float32, "fp32: CPU")
    assert embedded.attn == "sdpa" and embedded.model.config._attn_implementation == "sdpa"
    assert embedded.eos_token_ids == frozenset({embedded.tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert (embedded.context_length, embedded.sliding_window, embedded.mixed_layer_types) == (8192, None, False)
    assert not embedded.model.training
    assert not any(p.requires_grad for p in embedded.model.parameters())
    assert all(p.dtype == torch.float32 for p in embedded.model.parameters())


def test_embedded_tokenizer_keeps_the_chatml_template(embedded):
    assert embedded.has_chat_template
    text = embedded.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_embedded_model_answers_a_simple_question(embedded):
    ids = chat_ids(embedded.tokenizer)
    with torch.no_grad():
        out = plain(embedded.model).generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in embedded.tokenizer.decode(out[0, ids.shape[1] :])


def test_converted_copy_is_cached_under_the_gguf_hash():
    folder = embedded_model_dir()
    digest = gguf_sha256(embedded_gguf_path())
    assert folder == cache_root() / "models" / f"smollm2-135m-instruct-{digest[:16]}"
    assert embedded_model_dir() == folder
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())


@pytest.mark.slow
def test_the_embedded_model_and_its_gguf_loaded_by_path_give_the_same_logits(embedded):
    from_gguf = load_model(str(embedded_gguf_path()), quiet=True)
    assert from_gguf.has_chat_template and from_gguf.eos_token_ids == embedded.eos_token_ids
    ids = chat_ids(embedded.tokenizer)
    assert torch.equal(ids, chat_ids(from_gguf.tokenizer))
    tokens = ids[0]
    positions = torch.arange(len(tokens))
    expected = from_gguf.forward(tokens, positions, None, new_cache(), positions)
    actual = embedded.forward(tokens, positions, None, new_cache(), positions)
    assert torch.equal(actual, expected)


# --- the cache ------------------------------------------------------------------------------


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MDCLI_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == Path.home() / ".cache" / "mdcli"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "mdcli"
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(tmp_path / "own"))
    assert cache_root() == tmp_path / "own"


def test_sha256_is_remembered_until_the_file_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(tmp_path / "cache"))
    blob = tmp_path / "model.gguf"
    blob.write_bytes(b"not really a gguf")
    real = gguf_sha256(blob)
    stamp_file = tmp_path / "cache" / "gguf-sha256.json"
    stamps = json.loads(stamp_file.read_text())
    stamps[str(blob.resolve())]["sha256"] = "f" * 64  # a stale stamp is believed while size+mtime match
    stamp_file.write_text(json.dumps(stamps))
    assert gguf_sha256(blob) == "f" * 64
    stat = blob.stat()
    os.utime(blob, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_sha256(blob) == real


def test_an_existing_converted_copy_is_used_as_is(monkeypatch, tmp_path):
    """What a process that lost the conversion race sees: the winner's folder, untouched."""
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / f"smollm2-135m-instruct-{gguf_sha256(embedded_gguf_path())[:16]}"
    target.mkdir(parents=True)
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        (target / name).write_text("theirs")
    messages: list[str] = []
    assert embedded_model_dir(progress=messages.append) == target
    assert messages == [] and (target / "config.json").read_text() == "theirs"


def test_an_unwritable_cache_is_a_one_line_load_error(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("MDCLI_CACHE_DIR", str(blocker))
    with pytest.raises(ModelLoadError) as info:
        embedded_model_dir()
    assert_one_line(info.value, "cannot write the converted model", "MDCLI_CACHE_DIR")


# --- device and dtype -----------------------------------------------------------------------


@no_cuda_only
def test_auto_device_and_dtype_on_cpu(monkeypatch):
    monkeypatch.delenv("MDCLI_DEVICE", raising=False)
    device = resolve_device("auto")
    assert device == torch.device("cpu")
    assert resolve_dtype("auto", device) == (torch.float32, "fp32: CPU")
    assert resolve_dtype("bf16", device) == (torch.bfloat16, "requested")
    assert resolve_dtype("float32", device) == (torch.float32, "requested")


def test_bfloat16_on_cpu_is_honoured(tiny):
    loaded = load_model(str(tiny["llama"]), device="cpu", dtype="bfloat16", quiet=True)
    assert (loaded.dtype, loaded.dtype_reason) == (torch.bfloat16, "requested")
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    with torch.no_grad():
        assert loaded.model(chat_ids(loaded.tokenizer)).logits.dtype == torch.bfloat16


def test_float16_on_cpu_is_refused(tiny):
    with pytest.raises(UsageError) as info:
        load_model(str(tiny["llama"]), device="cpu", dtype="float16")
    assert_one_line(info.value, "float16", "--dtype float32")


@pytest.mark.parametrize("flag", ["load_in_4bit", "load_in_8bit"])
def test_bitsandbytes_on_a_cpu_device_is_refused_with_or_without_a_gpu(tiny, flag):
    with pytest.raises(UsageError) as info:
        load_model(str(tiny["llama"]), device="cpu", **{flag: True})
    assert_one_line(info.value, "CUDA", "--device cuda")


def test_auto_device_follows_mdcli_device_when_set(monkeypatch):
    monkeypatch.setenv("MDCLI_DEVICE", "CPU ")
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setenv("MDCLI_DEVICE", "auto")
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")


def test_an_explicit_device_outranks_mdcli_device(monkeypatch):
    monkeypatch.setenv("MDCLI_DEVICE", "cuda:7")
    assert resolve_device("cpu") == torch.device("cpu")


def test_unknown_mdcli_device_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("MDCLI_DEVICE", "tpu")
    with pytest.raises(UsageError) as info:
        resolve_device("auto")
    assert_one_line(info.value, "'tpu' in $MDCLI_DEVICE", "set MDCLI_DEVICE to auto, cpu")


@pytest.mark.parametrize(("option", "value"), [("device", "tpu"), ("dtype", "int8")])
def test_unknown_device_or_dtype_is_refused(tiny, option, value):
    with pytest.raises(UsageError) as info:
        load_model(str(tiny["llama"]), **{option: value})
    assert_one_line(info.value, value, f"--{option}")


@no_cuda_only
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_refused(tiny, device):
    with pytest.raises(UsageError) as info:
        load_model(str(tiny["llama"]), device=device)
    assert_one_line(info.value, "CUDA is not available", "--device cpu")


@no_cuda_only
@pytest.mark.parametrize("flag", ["load_in_4bit", "load_in_8bit"])
def test_bitsandbytes_without_cuda_is_refused(tiny, flag):
    with pytest.raises(UsageError) as info:
        load_model(str(tiny["llama"]), **{flag: True})
    assert_one_line(info.value, "needs a CUDA GPU", "--load-in-")


def test_4bit_and_8bit_together_are_refused(tiny):
    with pytest.raises(UsageError) as info:
        load_model(str(tiny["llama"]), load_in_4bit=True, load_in_8bit=True)
    assert_one_line(info.value, "--load-in-4bit", "--load-in-8bit")


# --- where the model comes from -------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_load_through_the_real_path(tiny, arch):
    loaded = load_model(str(tiny[arch]), quiet=True)
    assert loaded.name == str(tiny[arch]) and loaded.has_chat_template
    assert loaded.eos_token_ids == frozenset({loaded.tokenizer.eos_token_id})
    assert loaded.context_length == 2048 and not loaded.model.training
    with torch.no_grad():
        logits = loaded.model(chat_ids(loaded.tokenizer)).logits
    assert logits.shape[-1] == len(loaded.tokenizer) and torch.isfinite(logits).all()


@pytest.mark.parametrize("missing", ["./no-such-model", "/no/such/folder", "no/such/model/here", "missing.gguf"])
def test_missing_local_path_is_a_usage_error(missing):
    with pytest.raises(UsageError) as info:
        load_model(missing)
    assert_one_line(info.value, "does not exist")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"x")
    with pytest.raises(UsageError) as info:
        load_model(str(weights))
    assert_one_line(info.value, "not a .gguf")


def test_empty_model_name_is_refused():
    with pytest.raises(UsageError) as info:
        load_model("  ")
    assert_one_line(info.value, "empty")


def test_broken_weights_are_a_one_line_load_error(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "llama")
    (folder / "model.safetensors").write_bytes(b"not safetensors" * 8)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(folder), quiet=True)
    assert_one_line(info.value, str(folder), "header")


def test_tiny_models_share_the_embedded_tokenizer(tiny):
    from tests import tiny_models

    assert tiny_models.TOKENIZER_SOURCE == embedded_model_dir()
    assert (tiny["gpt2"] / "tokenizer.json").read_bytes() == (tiny["llama"] / "tokenizer.json").read_bytes()


def test_unknown_hub_id_offline_is_a_one_line_load_error(tmp_path):
    code = (
        "from mdcli.models.load import load_model\n"
        "from mdcli.errors import ModelLoadError\n"
        "try:\n    load_model('mdcli-tests/no-such-model', quiet=True)\n"
        "except ModelLoadError as e:\n    print('ERROR:' + str(e))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(lines) == 1, done.stdout + done.stderr
    assert "HF_HUB_OFFLINE is set" in lines[0] and "mdcli-tests/no-such-model" in lines[0]
    assert "local folder or .gguf" in lines[0]


@contextlib.contextmanager
def a_hub_that_never_answers(tmp_path: Path):
    """The environment of an mdcli process whose hub is a local port nothing listens on (bound, so
    no other process takes it, never listening, so a connection is refused at once), with an empty
    Hugging Face cache and HF_HUB_OFFLINE unset: a machine without network, as far as mdcli can tell."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env.update(HF_ENDPOINT=f"http://127.0.0.1:{closed.getsockname()[1]}", HF_HOME=str(tmp_path / "hf"))
        yield env


def mdcli_info(model: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mdcli", "info", "-m", model], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    return done, time.monotonic() - start


def test_a_hub_id_without_network_fails_at_once_in_one_line_that_says_how_to_get_it(tmp_path):
    # issue 53, item 11: transformers retried the hub five times (five "Retrying in 8s" lines, ~23 s)
    with a_hub_that_never_answers(tmp_path) as env:
        done, seconds = mdcli_info("mdcli-tests/no-such-model", env)
    assert done.returncode == 1, done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    line = done.stderr.strip()
    assert line.startswith("mdcli: error: cannot reach the Hugging Face hub (http://127.0.0.1:"), line
    assert "'mdcli-tests/no-such-model' is not in the local Hugging Face cache" in line
    assert "hf download mdcli-tests/no-such-model" in line and "local folder or .gguf" in line
    assert seconds < 20  # start-up and the refused connection; the retries alone took 23 s


def test_a_hub_id_in_the_local_cache_loads_from_it_when_the_hub_never_answers(tiny, tmp_path):
    with a_hub_that_never_answers(tmp_path) as env:
        repo = Path(env["HF_HOME"]) / "hub" / "models--mdcli-tests--tiny-llama"
        commit = "0" * 40
        shutil.copytree(tiny["llama"], repo / "snapshots" / commit)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        done, _ = mdcli_info("mdcli-tests/tiny-llama", env)
    assert done.returncode == 0, done.stderr
    assert "model: mdcli-tests/tiny-llama" in done.stdout
    assert "Retry" not in done.stderr and "huggingface.co" not in done.stderr


def test_quiet_loading_prints_nothing_and_reports_progress(tiny, capfd):
    messages: list[str] = []
    load_model(str(tiny["qwen2"]), quiet=True, progress=messages.append)
    captured = capfd.readouterr()
    assert (captured.out, captured.err) == ("", "")
    assert messages == [f"loading {tiny['qwen2']}..."]


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "reason"), [("bloom", "ALiBi"), ("mamba", "recurrent")])
@pytest.mark.parametrize("with_weights", [False, True])
def test_refused_architectures_fail_before_weights_load(tmp_path, kind, reason, with_weights):
    folder = make_refused_model(kind, tmp_path / kind, with_weights=with_weights)
    with pytest.raises(UnsupportedModelError) as info:  # without weights: proof no weight was read
        load_model(str(folder), quiet=True)
    assert_one_line(info.value, kind, reason, "RoPE or learned positions")


@pytest.mark.parametrize("attn", ["flash_attention_2", "flex_attention", "paged|sdpa"])
def test_attention_without_arbitrary_masks_is_refused(tiny, attn):
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(tiny["llama"]), attn=attn)
    assert_one_line(info.value, attn, "--attn sdpa")


def test_eager_attention_is_accepted(tiny):
    loaded = load_model(str(tiny["gpt2"]), attn="eager", quiet=True)
    assert loaded.attn == "eager" and loaded.model.config._attn_implementation == "eager"


def test_models_without_sdpa_ask_for_eager(tmp_path):
    from transformers import Gemma2Config

    Gemma2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
    ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(tmp_path), attn="sdpa")
    assert_one_line(info.value, "gemma2", "--attn eager")


def _config(model_type: str, **kwargs):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kwargs)


@pytest.mark.parametrize(
    ("model_type", "kwargs", "reason"),
    [
        ("falcon", {"alibi": True}, "ALiBi"),
        ("mpt", {}, "ALiBi"),
        ("llama", {"position_embedding_type": "alibi"}, "ALiBi"),
        ("qwen3_next", {}, "recurrent"),
        ("jamba", {}, "recurrent"),
        (
            "llama",
            {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]},
            "'linear_attention' layers",
        ),
        ("llama4_text", {}, "'chunked_attention' layers"),
        ("t5", {}, "encoder-decoder"),
    ],
)
def test_check_exact_support_refusals(model_type, kwargs, reason):
    with pytest.raises(UnsupportedModelError) as info:
        check_exact_support(_config(model_type, **kwargs), "sdpa")
    assert_one_line(info.value, model_type, reason)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2", "mistral", "gemma3_text", "gemma2", "falcon"])
def test_check_exact_support_accepts_attention_models(model_type):
    check_exact_support(_config(model_type), "eager")


# --- sliding windows, context, eos ----------------------------------------------------------


def test_sliding_window_layout_of_tiny_models(tiny):
    mistral = load_model(str(tiny["mistral"]), quiet=True)
    gemma3 = load_model(str(tiny["gemma3"]), quiet=True)
    assert (mistral.sliding_window, mistral.mixed_layer_types) == (TINY_SLIDING_WINDOW, False)
    assert (gemma3.sliding_window, gemma3.mixed_layer_types) == (TINY_SLIDING_WINDOW, True)


@pytest.mark.parametrize(
    ("model_type", "kwargs", "layout"),
    [
        ("llama", {}, (None, False)),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 4096}, (None, False)),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 16, "num_hidden_layers": 4, "max_window_layers": 2},
            (16, True),
        ),
        ("mistral", {"sliding_window": None}, (None, False)),
        ("gemma2", {"sliding_window": 32}, (32, True)),
    ],
)
def test_sliding_window_layout_from_configs(model_type, kwargs, layout):
    assert sliding_window_layout(_config(model_type, **kwargs)) == layout


def test_context_length_reads_the_usual_fields():
    assert context_length(_config("gpt2", n_positions=321)) == 321
    assert context_length(_config("llama", max_position_embeddings=4096)) == 4096
    assert context_length(_config("mamba")) is None


def test_eos_ids_include_generation_config_ones(tiny, tmp_path):
    from transformers import GenerationConfig

    folder = make_tiny_model("llama", tmp_path / "llama")
    GenerationConfig(eos_token_id=[2, 7], bos_token_id=1).save_pretrained(folder)
    assert load_model(str(folder), quiet=True).eos_token_ids == frozenset({2, 7})
    assert eos_token_ids(None, GenerationConfig(eos_token_id=5)) == frozenset({5})


# --- GPU (skipped without CUDA) -------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_embedded_model_on_cuda_in_bf16():
    loaded = load_model(device="cuda", quiet=True)
    assert loaded.device.type == "cuda"
    if torch.cuda.is_bf16_supported():
        assert (loaded.dtype, loaded.dtype_reason) == (torch.bfloat16, "bf16: CUDA supports bf16")
    with torch.no_grad():
        logits = loaded.model(chat_ids(loaded.tokenizer).to(loaded.device)).logits
    assert torch.isfinite(logits.float()).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes (pip install 'mdcli[cuda]')")
@pytest.mark.parametrize("bits", [4, 8])
def test_embedded_model_quantized_with_bitsandbytes(bits):
    loaded = load_model(device="cuda", load_in_4bit=bits == 4, load_in_8bit=bits == 8, quiet=True)
    assert loaded.device.type == "cuda" and loaded.dtype_reason.startswith(f"{bits}-bit bitsandbytes")
    with torch.no_grad():
        logits = loaded.model(chat_ids(loaded.tokenizer).to(loaded.device)).logits
    assert torch.isfinite(logits.float()).all()


# --- the tokenizer alone (mdcli explain) -----------------------------------------------------


def test_load_tokenizer_is_load_models_tokenizer_without_the_weights(tiny):
    from mdcli import load_tokenizer

    folder = str(tiny["qwen2"])
    alone = load_tokenizer(folder)
    assert alone("hello there")["input_ids"] == load_model(folder).tokenizer("hello there")["input_ids"]
    with pytest.raises(UsageError) as info:
        load_tokenizer("./no-such-model")
    assert_one_line(info.value, "does not exist")
