"""The exact forest engine: forest, one shared KV cache, one forward per step, the step loop with verification, sampling and detokenizing. torch only: no host rules, no CLI."""
