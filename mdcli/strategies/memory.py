"""What a forest holds at its peak, estimated before any forward: a run that cannot fit in the free
memory of its device is refused up front, in one line with the numbers and what to lower, rather
than killed by the kernel midway (issue 53: `think --paths 100000` took 23 GiB and exit 137).

The estimate is an upper one. The cache: every prompt token once where prompts share it (they are
prefilled as one trie) plus every branch's new tokens, nothing compacted. Each step: the logits of
every live branch and two float32 copies of them (the filtered logits, the probabilities), and
the mask rows of the branches' new tokens over the whole cache. beam (beam/rules.py) and margins
(margins/fit.py) keep their own, finer estimates on the same terms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mdcli.backends.host import available_memory_bytes
from mdcli.prefixes import trie_size
from mdcli.models.memory import kv_bytes_per_token
from mdcli.strategies.job import FieldError

if TYPE_CHECKING:
    from mdcli.models.load import LoadedModel


def trie_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens the prompts take in the cache: their token trie's size (mdcli.prefixes.trie_size)."""
    return trie_size(prompts)


def forest_peak_bytes(*, kv_per_token: int, cache_tokens: int, branches: int, vocab_size: int, dtype_bytes: int) -> int:
    """The estimate of the module docstring for `branches` live branches over `cache_tokens`."""
    kv = kv_per_token * cache_tokens
    scores = 3 * branches * vocab_size * 4
    mask = branches * cache_tokens * (dtype_bytes + 1)
    return kv + scores + mask


def check_forest_fits(model: LoadedModel, *, prompt_tokens: int, branches: int, new_tokens: int, what: str,
                      fix: str) -> None:
    """Refuse a forest of `branches` branches over `prompt_tokens` prompt tokens (as the cache holds
    them) that each write up to `new_tokens`, when its estimate exceeds the device's free memory.
    `what` names the branches in the error ("{paths} 100000"), `fix` what to lower."""
    free = available_memory_bytes(model.device)
    if free is None:
        return
    dtype_bytes = model.dtype.itemsize
    needed = forest_peak_bytes(
        kv_per_token=kv_bytes_per_token(model.model.config, dtype_bytes),
        cache_tokens=prompt_tokens + branches * new_tokens,
        branches=branches,
        vocab_size=_vocab_size(model),
        dtype_bytes=dtype_bytes,
    )
    if needed > free:
        raise FieldError(
            f"{what} needs about {needed / 2**30:,.1f} GiB for the KV cache and each step's scores "
            f"({branches:,} branches of up to {new_tokens:,} new tokens), but only {free / 2**30:,.1f} GiB is free "
            f"on {model.device}",
            fix=fix,
        )


def _vocab_size(model: LoadedModel) -> int:
    head = model.model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.model.config.vocab_size)
