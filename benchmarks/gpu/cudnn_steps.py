"""Decode-step times on CUDA with and without cuDNN attention (MDCLI_CUDNN_ATTENTION), random
weights of the embedded model's shape, bf16: two passes over the same lengths, 1 and 8 branches.

    python3 benchmarks/gpu/cudnn_steps.py                              # mdcli's default: no cuDNN
    MDCLI_CUDNN_ATTENTION=1 python3 benchmarks/gpu/cudnn_steps.py      # torch's default
    DEV=cpu DOC=50 STEPS=3 python3 benchmarks/gpu/cudnn_steps.py float32   # a quick check without a GPU

Output of one H100 run: gpu-h100-cudnn-attention.txt, in git history (notebook/README.md)."""
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from mdcli.bench import RANDOM_SHAPES
from mdcli.core.engine import Engine

family, hidden, layers, heads, kv_heads, inter, vocab, head_dim = RANDOM_SHAPES["llama-135m"]
config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                     max_position_embeddings=16384, **({"head_dim": head_dim} if head_dim else {}))
torch.manual_seed(0)
dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
dev = os.environ.get("DEV", "cuda")
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
with torch.device(dev):
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
doc = torch.randint(0, vocab, (int(os.environ.get("DOC", 1500)),)).tolist()
steps = int(os.environ.get("STEPS", 64))
for branches in (1, 8):
    for rep in (1, 2):
        engine = Engine(model)
        (prefix,) = engine.forward(torch.zeros(1, 0, dtype=torch.bool), [doc])
        rows = prefix.row[None].expand(branches, -1)
        chains = [[int(t)] for t in torch.randint(0, vocab, (branches,))]
        sync(); start = time.perf_counter()
        for _ in range(steps):
            results = engine.forward(rows, chains)
            rows = torch.stack([r.row for r in results])
            chains = [[int(r.logits.argmax())] for r in results]
        sync()
        print(f"cudnn={os.environ.get('MDCLI_CUDNN_ATTENTION', '0')} {dtype} branches={branches} pass={rep}: "
              f"{(time.perf_counter() - start) / steps * 1000:.1f} ms/step", flush=True)
