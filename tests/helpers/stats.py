"""The one goodness-of-fit test the losslessness tests share."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare


def chi2_p(draws, probs, min_expected: float = 0.0) -> float:
    """Pearson chi-square p-value of integer `draws` against the distribution `probs` (numpy or torch).

    A draw where `probs` is 0 gives p = 0 (a lossy sampler can emit an impossible token); bins expected
    under `min_expected` counts are pooled into one, as the test needs for large vocabularies.
    """
    draws = draws.cpu().numpy() if isinstance(draws, torch.Tensor) else np.asarray(draws)
    probs = probs.double().cpu().numpy() if isinstance(probs, torch.Tensor) else np.asarray(probs, dtype=float)
    counts = np.bincount(draws, minlength=len(probs)).astype(float)
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs / probs.sum() * len(draws)
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)
