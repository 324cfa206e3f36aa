"""The reference every exactness test compares with: a branch's prompt run alone through the
plain model, greedy, with Hugging Face's own `generate`."""

from __future__ import annotations

import torch


def generate_alone(model, prompt_ids: list[int], new_tokens: int, *, device=None) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids], device=device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
            do_sample=False,
            max_new_tokens=new_tokens,
        )
    return out[0, len(prompt_ids) :].tolist()
