"""Acceptance of a draft measured on validation data, from the two distributions (docs/definitions.md).

At every response position t, with p the target's and q the draft's next-token distribution:
alpha_t = sum_v min(p, q) (temperature 1; exact expected acceptance of one drafted token) and, at
temperature 0, a_t = [argmax q == argmax p]. A chain drafted at t is accepted up to position k
with probability prod_{j<k} a_{t+j} along the target's own continuation (teacher forcing: exact at
temperature 0 on greedy data, the usual estimate otherwise), so from the sums S_k = sum_t prod_{j<k} a_{t+j}
alpha_pos{k} = S_k / S_{k-1} and tau_sim(K) = 1 + sum_{k<=K} S_k / S_0.

The states are sums (float64), synced across ranks by torchmetrics before `compute`: a multi-process
validation gives the numbers of a single process on the same data, whatever each rank holds.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric


def token_acceptance(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha = sum min(p, q) at temperature 1, greedy agreement) per position, float32, over the full vocabulary."""
    p = torch.softmax(teacher_logits.float(), -1)
    q = torch.softmax(student_logits.float(), -1)
    alpha = torch.minimum(p, q).sum(-1).clamp(max=1.0)
    greedy = (teacher_logits.argmax(-1) == student_logits.argmax(-1)).float()
    return alpha, greedy


def chain_sums(a: torch.Tensor, mask: torch.Tensor, max_k: int) -> torch.Tensor:
    """[max_k + 1]: S_0 = number of start positions, S_k = sum over starts of prod_{j<k} a_{t+j}.

    `a` and `mask` are [B, T]; a chain cannot run past the response (a = 0 off the mask).
    """
    a = torch.where(mask, a.double(), torch.zeros((), dtype=torch.float64, device=a.device))
    sums = [mask.sum().double()]
    prod = mask.double()
    for k in range(max_k):
        shifted = torch.zeros_like(a)
        shifted[:, : a.shape[1] - k] = a[:, k:]  # a_{t+k}
        prod = prod * shifted
        sums.append(prod.sum())
    return torch.stack(sums)


class ChainSums(Metric):
    """The chain sums S_0..S_max_k at temperature 1 and 0 (summed across ranks) and what follows from them:
    alpha_pos{k} = S_k / S_{k-1} and tau_sim{K} = 1 + sum_{k<=K} S_k / S_0 (`_t0` at temperature 0)."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, max_k: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.max_k = max_k
        self.add_state("sums_t1", torch.zeros(max_k + 1, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sums_t0", torch.zeros(max_k + 1, dtype=torch.float64), dist_reduce_fx="sum")

    def chain_values(self) -> dict[str, torch.Tensor]:
        n = self.sums_t1[0].clamp(min=1)
        out = {"tokens": self.sums_t1[0]}
        for tag, sums in (("", self.sums_t1), ("_t0", self.sums_t0)):
            for k in range(1, self.max_k + 1):
                out[f"alpha_pos{k}{tag}"] = sums[k] / sums[k - 1].clamp(min=1e-12)
                out[f"tau_sim{k}{tag}"] = 1 + sums[1:k + 1].sum() / n
        return out


class AcceptanceMetric(ChainSums):
    """val/alpha, val/alpha_pos{k}, val/tau_sim{K} at temperature 1, and their temperature-0 twins."""

    def __init__(self, max_k: int = 8, **kwargs):
        super().__init__(max_k, **kwargs)
        self.add_state("alpha", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("greedy", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Logits [N, V] at the N positions of the loss mask [B, T] (row-major order), the student's
        already in the target's vocabulary."""
        alpha, greedy = token_acceptance(teacher_logits, student_logits)
        self.alpha += alpha.double().sum()
        self.greedy += greedy.double().sum()
        for sums, per_token in ((self.sums_t1, alpha), (self.sums_t0, greedy)):
            on_grid = torch.zeros(mask.shape, device=per_token.device)  # back to [B, T] for the chains
            on_grid[mask] = per_token
            sums += chain_sums(on_grid, mask, self.max_k)

    def compute(self) -> dict[str, torch.Tensor]:
        n = self.sums_t1[0].clamp(min=1)
        return {"alpha": self.alpha / n, "alpha_t0": self.greedy / n, **self.chain_values()}


class HeadAccuracy(Metric):
    """Per-head validation figures of heads that each predict a fixed number of steps ahead (Medusa).

    For head k at every scored position: the rank of the target's top token among the head's logits
    (full vocabulary; a token the head cannot emit is never hit), kept as counts of rank i for
    i < max_rank (so top-i accuracy and the tree builder's acc[k][i] both follow), and the head's
    expected acceptance alpha = sum min(p, q) at temperature 1. Sums, synced across ranks.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, num_heads: int, max_rank: int = 10, **kwargs):
        super().__init__(**kwargs)
        self.num_heads, self.max_rank = num_heads, max_rank
        self.add_state("rank_hits", torch.zeros(num_heads, max_rank, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("alpha", torch.zeros(num_heads, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(num_heads, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, k: int, teacher_logits: torch.Tensor, head_logits: torch.Tensor) -> None:
        """Head k (1-based), logits [N, V] at its N positions, the head's already over the target's vocabulary."""
        if not len(teacher_logits):
            return
        alpha, _ = token_acceptance(teacher_logits, head_logits)
        head_logits = head_logits.float()
        best = head_logits.gather(-1, teacher_logits.argmax(-1, keepdim=True))  # the head's score of the target's token
        rank = (head_logits > best).sum(-1)
        rank = torch.where(torch.isfinite(best[:, 0]), rank, torch.full_like(rank, self.max_rank))
        self.rank_hits[k - 1] += torch.bincount(rank.clamp(max=self.max_rank),
                                                minlength=self.max_rank + 1)[:-1].double()
        self.alpha[k - 1] += alpha.double().sum()
        self.count[k - 1] += len(alpha)

    def compute(self) -> dict[str, torch.Tensor]:
        n = self.count.clamp(min=1)
        acc = self.rank_hits / n[:, None]
        out: dict[str, torch.Tensor] = {"acc": acc}
        for k in range(self.num_heads):
            out[f"head{k + 1}_top1"] = acc[k, 0]
            out[f"head{k + 1}_top5"] = acc[k, :5].sum()
            out[f"head{k + 1}_alpha"] = self.alpha[k] / n[k]
        return out


class UnrolledAcceptance(ChainSums):
    """Acceptance of a head unrolled on its own predictions (EAGLE), from per-step grids.

    Step k's grid [B, T] holds, at every anchor t where step k is scored, alpha = sum min(p, q)
    (temperature 1) or greedy agreement (temperature 0) of the token k+1 steps after the anchor's
    first draft, 0 elsewhere. As in `AcceptanceMetric`, S_k = sum over anchors of prod_{j<k} a_j and
    alpha_pos{k} = S_k / S_{k-1}, tau_sim(K) = 1 + sum_{k<=K} S_k / S_0; summed across ranks.
    """

    def update(self, alpha_steps: list[torch.Tensor], greedy_steps: list[torch.Tensor], start: torch.Tensor) -> None:
        for sums, grids in ((self.sums_t1, alpha_steps), (self.sums_t0, greedy_steps)):
            prod = start.double()
            sums[0] += prod.sum()
            for k, grid in enumerate(grids[: self.max_k], start=1):
                prod = prod * grid.double()
                sums[k] += prod.sum()

    def compute(self) -> dict[str, torch.Tensor]:
        out = self.chain_values()
        out["alpha"], out["alpha_t0"] = out["alpha_pos1"], out["alpha_pos1_t0"]
        return out
