"""Warping and sampling: the fast nucleus equals the sort-based definition; samples follow the distribution."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdistill.core.sampling import sample, sample_logits, warp

from .helpers.stats import chi2_p


def reference_warp(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The textbook definition: sort, cut at top-k, renormalise, cut at the nucleus, renormalise."""
    probs = torch.softmax(logits.double() / temperature, -1)
    vals, idx = torch.sort(probs, descending=True)
    if top_k > 0:
        vals = vals[..., :top_k] / vals[..., :top_k].sum(-1, keepdim=True)
        idx = idx[..., :top_k]
    keep = (vals.cumsum(-1) - vals) < top_p
    vals = torch.where(keep, vals, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, idx, vals)
    return out / out.sum(-1, keepdim=True)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 3000), rows=st.integers(1, 4),
       scale=st.floats(0.1, 12.0), temperature=st.floats(0.3, 2.0), top_p=st.floats(0.05, 1.0),
       top_k=st.sampled_from([0, 0, 1, 5, 50]))
def test_warp_equals_sort_based_definition(seed, vocab, rows, scale, temperature, top_p, top_k):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    got = warp(logits, temperature, top_p, top_k).double()
    want = reference_warp(logits, temperature, top_p, top_k)
    # ties at the nucleus boundary may be broken differently; random floats have none
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.allclose(got.sum(-1), torch.ones(rows, dtype=torch.float64), atol=1e-5)


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 100)
    assert torch.equal(sample_logits(logits, 0.0), logits.argmax(-1))
    assert torch.equal(warp(logits, 0.0).argmax(-1), logits.argmax(-1))


def test_nucleus_wider_than_first_candidates():
    logits = torch.zeros(2, 5000)  # uniform: the nucleus holds 95% of the vocabulary
    logits[1, 0] = 20.0  # peaked row beside a flat one
    p = warp(logits, 1.0, top_p=0.95)
    assert int((p[0] > 0).sum()) == 4750 and int((p[1] > 0).sum()) == 1


def test_samples_follow_the_warped_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 40, generator=g) * 2
    probs = warp(logits, 0.8, top_p=0.9)[0].double().numpy()
    n = 40_000
    draws = sample_logits(logits.expand(n, -1), 0.8, top_p=0.9, generator=torch.Generator().manual_seed(1))
    assert chi2_p(draws, probs) > 1e-3


def test_chi_square_can_fail():
    """The same test rejects samples from a different distribution (so the test above can fail)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 40, generator=g) * 2
    probs = warp(logits, 1.0)[0].double().numpy()
    draws = sample(warp(logits * 1.1, 1.0).expand(40_000, -1), torch.Generator().manual_seed(1))
    assert chi2_p(draws, probs) < 1e-6
