"""One-off diagnostic: every engine forward of a forest+speculate run, timed by width, and what
auto's cost model learnt. `python benchmarks/gpu/forward_widths.py BRANCHES TOKENS [auto|off|N]`;
the device is $MDCLI_DEVICE (cpu unless set)."""
import sys
import time
from collections import defaultdict

import mdcli.speculative.planner as speculate
from mdcli.bench.ask import Case, forest, prompts_for
from mdcli.core.engine import Engine
from mdcli.models.load import load_model

timed = []
for name in ("forward", "forward_trees"):
    def wrapped(self, rows, chains, *a, _orig=getattr(Engine, name), _name=name, **k):
        import torch

        started = time.perf_counter()
        out = _orig(self, rows, chains, *a, **k)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        timed.append((_name, sum(map(len, chains)), time.perf_counter() - started))
        return out
    setattr(Engine, name, wrapped)
policies = []
original_plan = speculate.SpeculationPolicy.plan


def plan(self, trees, room, remaining=None):
    if not policies or policies[-1] is not self:
        policies.append(self)
    return original_plan(self, trees, room, remaining)


speculate.SpeculationPolicy.plan = plan
model = load_model(None, quiet=True)
branches, new = int(sys.argv[1]), int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "auto"
prompts = prompts_for(model, Case(branches, 1500, new))
forest(model, prompts, Case(branches, 1500, 8), speculate=mode)  # warm up
timed.clear()
m = forest(model, prompts, Case(branches, 1500, new), speculate=mode)
print(f"{branches} x {new} {mode}: {m.seconds:.2f} s, {m.forwards} forwards, {m.draft_tokens} drafts, "
      f"{m.accepted_tokens} accepted")
by = defaultdict(list)
for name, tokens, seconds in timed:
    by[(name, tokens)].append(seconds)
print("  ".join(f"{n[0]}{t}:{len(v)}x{1000 * sorted(v)[len(v) // 2]:.1f}" for (n, t), v in sorted(by.items())))
if policies:
    cost = policies[-1].cost
    c, b = cost.extra_line()
    plain = cost.plain(branches)
    print(f"cost model: verifying costs a plain step x (1 + {c / plain:.3f} + {b / plain:.4f} per guess); "
          f"{cost.verifying} verifying steps timed")
