"""Metrics from per-generation records: counts are summed first and divided last (DESIGN.md, Metrics).

- tau: tokens emitted / target forwards, over all generations of a setting (AR gives 1).
- alpha_pos{k}: accepted / attempted at draft position k, given positions < k were accepted.
- tokens_per_s: tokens / seconds; speed-up: a method's tokens/s over AR's on the same prompts in the
  same run (equal to the ratio of wall times at temperature 0, where both emit the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def add(self, tokens: int, seconds: float, forwards: int = 0, attempts: list[int] | None = None,
            accepts: list[int] | None = None, draft_s: float = 0.0, verify_s: float = 0.0) -> None:
        self.generations += 1
        self.tokens += tokens
        self.seconds += seconds
        self.forwards += forwards
        self.draft_s += draft_s
        self.verify_s += verify_s
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
        if ar is not None and ar.tokens and self.seconds:
            out["speedup"] = round(out["tokens_per_s"] / (ar.tokens / ar.seconds), 4)
        return out


def expected_accepted_length(alpha: float, k: int) -> dict[str, float]:
    """The background text's eq. 2: the truncated sum over k of alpha^i (+1 for the target's token),
    and its limit 1/(1 - alpha), to set beside measured tau."""
    truncated = 1.0 + sum(alpha**i for i in range(1, k + 1))
    return {"truncated_sum": truncated, "geometric_limit": (1.0 / (1.0 - alpha)) if alpha < 1 else float("inf")}
