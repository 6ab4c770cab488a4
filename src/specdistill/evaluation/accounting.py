"""Metrics from per-generation records: counts are summed first and divided last (docs/definitions.md).

- tau: tokens emitted / target forwards, over all generations of a setting (AR gives 1).
- alpha_pos{k}: accepted / attempted at draft position k, given positions < k were accepted; attempts_pos{k}: the
  attempts (rounds that drafted position k with every earlier one accepted), what the ratio is out of.
- tokens_per_s: tokens / seconds; speed-up: a method's tokens/s over AR's on the same prompts in the
  same run (equal to the ratio of wall times at temperature 0, where both emit the same tokens).
- speedup_ci95: a 95% interval of that ratio over the generations, paired with their AR twins
  (`speedup_interval`): how much the figure owes to which prompts were drawn and to timing noise
  within the run. Drift between runs is not in it. The unit is a turn: an MT-bench second turn
  follows each method's own first answer, and the two turns of a conversation are left out
  separately, so the interval is if anything a little narrow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    attempts: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)
    generations: int = 0
    alpha_exact: list[float] = field(default_factory=list)  # sum min(p, q) at the first draft position
    kl: list[float] = field(default_factory=list)
    per_generation: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds), in run order

    def add(self, tokens: int, seconds: float, forwards: int = 0, attempts: list[int] | None = None,
            accepts: list[int] | None = None, draft_s: float = 0.0, verify_s: float = 0.0,
            alpha_exact: list[float] | None = None, kl: list[float] | None = None) -> None:
        self.generations += 1
        self.per_generation.append((tokens, seconds))
        self.tokens += tokens
        self.seconds += seconds
        self.forwards += forwards
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.alpha_exact.extend(alpha_exact or [])
        self.kl.extend(kl or [])
        for name, new in (("attempts", attempts), ("accepts", accepts)):
            if new:
                cur = getattr(self, name)
                cur.extend([0] * (len(new) - len(cur)))
                for i, v in enumerate(new):
                    cur[i] += v

    def summary(self, ar: Tally | None = None) -> dict[str, float]:
        out: dict[str, float] = {"tokens": self.tokens, "seconds": round(self.seconds, 3),
                                 "tokens_per_s": round(self.tokens / self.seconds, 3) if self.seconds else 0.0}
        if self.forwards:
            out["tau"] = round(self.tokens / self.forwards, 4)
            out["draft_s"], out["verify_s"] = round(self.draft_s, 3), round(self.verify_s, 3)
        for k, (n, a) in enumerate(zip(self.attempts, self.accepts, strict=True), start=1):
            if n:
                out[f"alpha_pos{k}"] = round(a / n, 4)
                out[f"attempts_pos{k}"] = n  # what alpha_pos{k} is out of: deep positions see few rounds
        if self.alpha_exact:  # eq. 4 of docs/definitions.md, checked position by position
            out["alpha_exact_pos1"] = round(sum(self.alpha_exact) / len(self.alpha_exact), 4)
            finite = [k for k in self.kl if math.isfinite(k)]
            if finite:
                bounds = [1 - math.sqrt(k / 2) for k in finite]
                out["pinsker_bound_pos1"] = round(sum(bounds) / len(bounds), 4)
            pairs = [(a, k) for a, k in zip(self.alpha_exact, self.kl, strict=False) if math.isfinite(k)]
            out["pinsker_violations"] = sum(a < 1 - math.sqrt(k / 2) - 1e-9 for a, k in pairs)
            out["drafted_positions"] = len(self.alpha_exact)
        if ar is not None and ar.tokens and self.seconds:
            out["speedup"] = round(out["tokens_per_s"] / (ar.tokens / ar.seconds), 4)
            interval = speedup_interval(self.per_generation, ar.per_generation)
            if interval is not None:
                out["speedup_ci95"] = interval
        return out


def speedup_interval(runs: list[tuple[int, float]], ar: list[tuple[int, float]],
                     level: float = 0.95) -> list[float] | None:
    """A `level` interval of the speed-up from paired (tokens, seconds) generations; None without pairs
    (the runner adds every method's generations in the same order, so index i is the same prompt).

    Jackknife-t on the log ratio: leave each generation out together with its AR twin, take the
    jackknife standard error of log(speed-up), and Student's t with n - 1 degrees of freedom. With the
    4-8 generations a set has here, a percentile bootstrap covered a known ratio only 79% / 87% of the
    time in simulation (the test beside it); this covers ~93-94%.
    """
    n = len(runs)
    if len(ar) != n or n < 2:
        return None
    x, a = np.asarray(runs, dtype=float), np.asarray(ar, dtype=float)
    x_out, a_out = x.sum(axis=0) - x, a.sum(axis=0) - a  # [n, 2]: the sums without generation i
    with np.errstate(divide="ignore", invalid="ignore"):
        log_ratio = np.log((x[:, 0].sum() / x[:, 1].sum()) / (a[:, 0].sum() / a[:, 1].sum()))
        left_out = np.log((x_out[:, 0] / x_out[:, 1]) / (a_out[:, 0] / a_out[:, 1]))
    if not (np.isfinite(log_ratio) and np.isfinite(left_out).all()):  # no tokens left: no ratio
        return None
    se = math.sqrt((n - 1) / n * float(((left_out - left_out.mean()) ** 2).sum()))
    from scipy.stats import t as student_t  # here: 1.4 s of the evaluate stage's 5.2 s of imports (-X importtime)

    q = float(student_t.ppf(0.5 + level / 2, n - 1))
    return [round(math.exp(log_ratio - q * se), 4), round(math.exp(log_ratio + q * se), 4)]


def expected_accepted_length(alpha: float, k: int) -> dict[str, float]:
    """Eq. 2 (docs/definitions.md): the truncated sum over k of alpha^i (+1 for the target's token),
    and its limit 1/(1 - alpha), to set beside measured tau."""
    truncated = 1.0 + sum(alpha**i for i in range(1, k + 1))
    return {"truncated_sum": truncated, "geometric_limit": (1.0 / (1.0 - alpha)) if alpha < 1 else float("inf")}


def two_proportion_z(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """z of the difference in first-position acceptance (|z| < 2: within the noise of the prompt count)."""
    if not a.get("drafts") or not b.get("drafts"):
        return None
    n1, n2 = a["drafts"], b["drafts"]
    x1, x2 = a["accepted_per_pos"][0], b["accepted_per_pos"][0]
    p = (x1 + x2) / (n1 + n2)
    se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
    return round((x1 / n1 - x2 / n2) / se, 3) if se > 0 else 0.0
