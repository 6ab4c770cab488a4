"""Logit warping and sampling, one definition for every stage.

`warp` turns logits into the distribution that is actually sampled from: temperature, then top-k,
then top-p (nucleus), renormalised over the full vocabulary. The speculative decoder applies the same
function to the target's p and the draft's q, which is what keeps speculative sampling lossless under
top-p / top-k. Top-p is computed over a `torch.topk` candidate set that grows until it holds the
nucleus: exact, and ~20x cheaper than sorting a 49k vocabulary for every row.
"""

from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p. temperature 0 gives a one-hot argmax."""
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    probs = torch.softmax(logits / temperature, dim=-1)
    vocab = probs.shape[-1]
    if (top_k <= 0 or top_k >= vocab) and top_p >= 1.0:
        return probs
    k = min(top_k, vocab) if top_k > 0 else min(256, vocab)
    while True:
        vals, idx = torch.topk(probs, k, dim=-1)  # sorted, descending
        if top_p >= 1.0:
            keep = torch.ones_like(vals, dtype=torch.bool)
            break
        cum = vals.cumsum(-1)
        # the nucleus: the smallest prefix whose mass reaches top_p (the token that crosses it is kept)
        keep = (cum - vals) < top_p
        if top_k > 0 or k >= vocab or bool((cum[..., -1] >= top_p).all()):
            break
        k = min(4 * k, vocab)
    out = torch.zeros_like(probs)
    out.scatter_(-1, idx, torch.where(keep, vals, torch.zeros_like(vals)))
    return out / out.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [..., V], by the exponential race argmax(p / E), E ~ Exp(1).

    Exact for categorical sampling, and several times faster than `torch.multinomial` on the CPU.
    """
    e = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=1e-30)
    return (probs / e).argmax(-1)


def sample_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return sample(warp(logits, temperature, top_p, top_k), generator)
