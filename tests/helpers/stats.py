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


# The lossless suite's sizes come from its power, not from its wall time. A Pearson chi-square over `categories`
# bins, at significance `alpha`, detects a law q != p with probability `power` once its noncentrality
# n * w^2 reaches lambda(df, alpha, power), where w^2 = sum (q - p)^2 / p (Cohen's effect size). By Cauchy-Schwarz
# w >= 2 * TV(p, q), so every deviation of total variation `tv` or more is caught once n >= lambda / (2 tv)^2.


def noncentrality(categories: int, alpha: float, power: float) -> float:
    """lambda: the noncentrality at which the chi-square test over `categories` bins rejects at `alpha` with
    probability `power` (the df is categories - 1; fewer live bins, as a top-p warp leaves, need less)."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    df = categories - 1
    critical = chi2.isf(alpha, df)
    return float(brentq(lambda lam: ncx2.sf(critical, df, lam) - power, 1e-9, 1e6))


def draws_to_detect(tv: float, categories: int, alpha: float, power: float) -> int:
    """The fewest draws at which every law at total variation `tv` or more from the reference is caught with
    probability `power` at significance `alpha`."""
    return int(np.ceil(noncentrality(categories, alpha, power) / (2 * tv) ** 2))


def smallest_detected_tv(draws: int, categories: int, alpha: float, power: float) -> float:
    """The inverse: the total variation from which on `draws` draws catch a deviation with probability `power`."""
    return float(np.sqrt(noncentrality(categories, alpha, power) / draws) / 2)


def effect_size(draws, probs) -> float:
    """Cohen's w of the law behind integer `draws` against `probs`, estimated without its chi-square bias
    ((chi2 - df) / n, clipped at 0): how far a broken rule moves the law, in the units the sizes are set in."""
    draws = np.asarray(draws)
    probs = probs.double().cpu().numpy() if isinstance(probs, torch.Tensor) else np.asarray(probs, dtype=float)
    live = probs > 0
    counts = np.bincount(draws, minlength=len(probs)).astype(float)
    n, expected = len(draws), probs / probs.sum() * len(draws)
    if counts[~live].sum() > 0:  # an impossible token drawn: as far as a law can be
        return float("inf")
    stat = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    return float(np.sqrt(max(stat - (live.sum() - 1), 0.0) / n))
