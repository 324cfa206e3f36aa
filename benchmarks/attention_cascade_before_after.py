"""The prefix plan before (d91bc27's prefix.py: one softmax over the prefix's and the rest's scores
concatenated) and after (cascade attention), and dense, on whole steps' attention (30 layers, cold
keys and values, rounds in alternating order, process CPU time):

    git show d91bc27:mdcli/backends/attention/prefix.py > /tmp/old_prefix.py
    PYTHONPATH=. taskset -c 1 python benchmarks/attention_cascade_before_after.py 16 /tmp/old_prefix.py
"""
import importlib.util
import sys

import torch

from mdcli.backends.attention import prefix as new
from mdcli.backends.attention.sparse import plan_for
from mdcli.bench.attention import DIM, HEADS, KV_HEADS, LAYERS, _dense_step, abba, margins_step, shared_document

spec = importlib.util.spec_from_file_location("old_prefix", sys.argv[2])
old = importlib.util.module_from_spec(spec)
sys.modules["old_prefix"] = old
spec.loader.exec_module(old)
torch.set_num_threads(1)


def cases_for(label, allowed):
    m, n = allowed.shape
    mask = torch.zeros(m, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    query = torch.randn(1, HEADS, m, DIM)
    caches = [(torch.randn(1, KV_HEADS, n + 512, DIM)[:, :, :n], torch.randn(1, KV_HEADS, n + 512, DIM)[:, :, :n]) for _ in range(LAYERS)]
    def old_run():
        prefixes, rows = torch.unique(old.visible_prefix(allowed), return_inverse=True)
        plan = old.plan_prefixes(mask, allowed, allowed, prefixes, rows)
        for k, v in caches: old.grouped_attention(plan, query, k, v, None, DIM ** -0.5)
    def new_run():
        plan = plan_for(mask, 12.0, "prefix")
        for k, v in caches: new.grouped_attention(plan, query, k, v, None, DIM ** -0.5)
    return {f"{label}: dense": _dense_step(query, caches, mask), f"{label}: prefix plan before": old_run,
            f"{label}: cascade (now)": new_run}
scenes = {"ask-many 8 x 1,800": shared_document(8, 1800, 25, 1).allowed,
          "ask-many 8 x 1,800, 64 written": shared_document(8, 1800, 25, 64).allowed,
          "margins 4 questions x 8 segments": margins_step(4, 8).allowed}
rounds = int(sys.argv[1])
print("| case | median ms | fastest ms |\n|---|---:|---:|")
for label, allowed in scenes.items():
    for name, (med, mn) in abba(cases_for(label, allowed), rounds).items():
        print(f"| {name} | {med:.1f} | {mn:.1f} |")
