"""A reduced draft vocabulary: the draft's head scores N target tokens, `d2t` maps them back.

`draft_vocabulary` picks the N tokens. Every method with a reduced head (the separate draft, Medusa heads, EAGLE-3,
DFlash) uses these maps, in training (the teacher renormalised over the draft's tokens) and in decoding (q is zero
off d2t, so the acceptance rule stays lossless).
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.core.errors import ConfigError


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d [vocab_size]: the draft id of every target token, -1 where the draft cannot emit it."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(len(d2t), device=d2t.device)
    return t2d


def to_target_logits(logits: torch.Tensor, d2t: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft logits [..., N] scattered over the target's vocabulary [..., vocab_size]; -inf elsewhere."""
    if d2t is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., d2t] = logits
    return full


def draft_vocabulary(token_lists: Any, n: int, vocab_size: int,
                     always: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """d2t: the `n` most frequent tokens (ties by id), sorted; `always` (e.g. stop tokens) included."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in token_lists:
        counts += torch.bincount(torch.as_tensor(ids, dtype=torch.long), minlength=vocab_size)
    if not 0 < n <= vocab_size:
        raise ConfigError(f"draft vocab_size={n} must be in 1..{vocab_size} (the target's vocabulary)")
    counts[list(always)] = counts.max() + 1
    return torch.sort(torch.topk(counts, n, sorted=True).indices).values
