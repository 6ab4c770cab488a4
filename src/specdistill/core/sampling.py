"""Logit warping and sampling, one definition for every stage.

`warp` turns logits into the distribution that is actually sampled from: temperature, then top-k,
then top-p (nucleus), renormalised. The speculative decoder applies the same function to the target's
p and the draft's q, which is what keeps speculative sampling lossless under top-p / top-k.

Cost matters on the CPU (a 49k vocabulary, dozens of rows per step): top-p takes a `torch.topk` over
a candidate count that provably holds the nucleus instead of sorting the vocabulary, sampling works
on those candidates only, and draws one uniform number per row (inverse CDF) rather than one per
vocabulary entry (the exponential race costs ~50 ms for 32 rows here).
"""

from __future__ import annotations

import torch

FIRST_CANDIDATES = 64  # most rows' nucleus fits; only the rest pay for a wider top-k


def _nucleus_mask(vals: torch.Tensor, top_p: float) -> torch.Tensor:
    """For probabilities sorted descending: keep the smallest prefix whose mass reaches top_p."""
    return (vals.cumsum(-1) - vals) < top_p


def candidates(probs: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The renormalised support after top-k then top-p, as (probs, token ids) [N, k]; None: the full vocabulary."""
    vocab = probs.shape[-1]
    use_k = 0 < top_k < vocab
    if not use_k and top_p >= 1.0:
        return None
    if use_k:  # renormalise over the top-k, then take the nucleus of that
        vals, idx = torch.topk(probs, top_k, dim=-1)
        vals = vals / vals.sum(-1, keepdim=True)
    else:
        vals, idx = torch.topk(probs, min(FIRST_CANDIDATES, vocab), dim=-1)
        wide = (vals.sum(-1) < top_p).nonzero().flatten()  # rows whose nucleus is larger
        if wide.numel():
            # Every nucleus token has p >= (1 - top_p) / V: were the crossing token below that, it and
            # all tokens after it would hold less than 1 - top_p mass, yet they hold more. So a top-k
            # over that many candidates is exact, and far cheaper than sorting the vocabulary.
            sub = probs[wide]
            k = max(int((sub >= (1.0 - top_p) / vocab).sum(-1).max()), vals.shape[-1])
            wvals, widx = torch.topk(sub, k, dim=-1)
            pad = k - vals.shape[-1]  # zero-probability padding: never sampled, adds nothing
            vals = torch.nn.functional.pad(vals, (0, pad)).index_copy_(0, wide, wvals)
            idx = torch.nn.functional.pad(idx, (0, pad)).index_copy_(0, wide, widx)
    if top_p < 1.0:
        vals = torch.where(_nucleus_mask(vals, top_p), vals, 0.0)
    return vals / vals.sum(-1, keepdim=True), idx


def warp(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p. temperature 0 gives a one-hot argmax."""
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    shape = logits.shape
    probs = torch.softmax(logits.reshape(-1, shape[-1]) / temperature, dim=-1)
    sparse = candidates(probs, top_p, top_k)
    if sparse is not None:
        probs = torch.zeros_like(probs).scatter_add_(-1, sparse[1], sparse[0])
    return probs.reshape(shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of `probs` [..., V] by inverse CDF (float64, so no entry is skewed)."""
    shape = probs.shape
    cdf = probs.reshape(-1, shape[-1]).double().cumsum(-1)
    # The stages seed a CPU generator per prompt; torch draws only on a generator's own device, so the
    # uniforms come from there and move to the probabilities (one seed: the same draws on CPU and GPU).
    where = cdf.device if generator is None else generator.device
    u = torch.rand((cdf.shape[0], 1), generator=generator, dtype=torch.float64,
                   device=where).to(cdf.device) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).clamp_(max=shape[-1] - 1)
    return idx.reshape(shape[:-1])


def sample_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample from `warp(logits, ...)` without materialising the full warped distribution."""
    if temperature <= 0:
        return logits.argmax(-1)
    shape = logits.shape
    probs = torch.softmax(logits.float().reshape(-1, shape[-1]) / temperature, dim=-1)
    sparse = candidates(probs, top_p, top_k)
    if sparse is None:
        return sample(probs, generator).reshape(shape[:-1])
    vals, idx = sparse
    return idx.gather(-1, sample(vals, generator)[:, None]).reshape(shape[:-1])
