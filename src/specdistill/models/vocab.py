"""A reduced draft vocabulary: the draft's head scores N target tokens, `d2t` maps them back.

Every method with a reduced head (the separate draft, Medusa heads, EAGLE-3) uses these two maps, in
training (the teacher renormalised over the draft's tokens) and in decoding (q is zero off d2t, so the
acceptance rule stays lossless).
"""

from __future__ import annotations

import torch


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
