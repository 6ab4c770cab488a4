"""method=dflash: a parallel block drafter (methods/dflash/model.py) trained on the frozen target's features.

Alignment (as in decoding): an anchor p is a position whose token x_p is a response token and whose next token
is scored; its block is [x_p, M, ..., M] at positions p..p+S-1 and sees the target's features at positions < p.
Slot j (1..S-1) drafts x_{p+j} and is scored against the target at position p+j-1 (its distribution of x_{p+j})
when that position is scored. Training takes `anchors` random anchors per sequence per step, all in one forward:
each block's queries see the context before its own anchor and the slots of their own block (a block-diagonal
mask), which is exactly what one block sees while drafting (`methods/dflash/proposer.py`; tested equal). Validation
takes every anchor, in chunks (blocks do not see each other, so chunking changes nothing).

A Markov head (DSpark, `markov_rank`) reads the token before each slot, x_{p+j-1}: the data's (teacher forcing),
where drafting reads the token drawn before it. The two agree wherever the slot can still be accepted, but the
accepted token follows the target's argmax at T = 0 and min(p, q) at T > 0, not the data's sampled answers, so
validation's tau_sim of a Markov head is somewhat optimistic beside the plain block's (the decoder's tau is not).

XPress's causal refiner (`refiner_rank`) reads the tokens before every slot of the block, teacher-forced from the
data; as in its paper it also trains `consistency_passes` free-running rounds, each slot's predecessor the previous
round's argmax (the recurrence its drafting solves; no gradient between rounds), weighted `consistency_weight`, and
keeps the block's own logits good with a `base_weight` term on them without the bias.

Loss: sum_j w_j D(p_{p+j-1} || q_j) / sum_j w_j with D from the registry (the target renormalised over the draft
vocabulary) and DFlash's position weights w_j = exp(-(j-1) / gamma), or D-PACE's (`step_weights=dpace`).
Validation: val/alpha_pos{j} and val/tau_sim of the chain the block drafts, over the full vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torchmetrics import MeanMetric

from specdistill.methods.dflash.model import MASK, DFlashDrafter
from specdistill.training.base import DistillModule, features_and_teacher
from specdistill.training.losses import Teacher, dpace_weights
from specdistill.training.metrics import UnrolledAcceptance, token_acceptance


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions p whose token x_p is a response token (p-1 scored) and whose next is scored (p)."""
    prev = torch.nn.functional.pad(loss_mask[:, :-1], (1, 0))
    return loss_mask & prev


def sample_anchors(valid: torch.Tensor, n: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n anchors per row, uniformly among `valid` ones: (positions [B, n], real [B, n])."""
    scores = torch.rand(valid.shape, generator=generator).to(valid.device)  # a CPU generator: the same draws anywhere
    scores = torch.where(valid, scores, torch.full_like(scores, -1.0))
    top = scores.topk(min(n, valid.shape[1]), dim=1)
    return top.indices, top.values >= 0


def all_anchors(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every valid anchor of each row, left-aligned: (positions [B, n], real [B, n]), n the most of any row."""
    n = max(int(valid.sum(1).max()), 1)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :n]
    return order, valid.gather(1, order)


def block_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, anchors: torch.Tensor, real: torch.Tensor,
                 size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots of N blocks per row: ids [B, N*S] (the anchor's token, then MASK), positions [B, N*S], and the
    attention mask [B, 1, N*S, T + N*S]: a block's queries see the context before its anchor and their own block."""
    b, t = input_ids.shape
    n = anchors.shape[1]
    ids = torch.full((b, n, size), MASK, dtype=torch.long, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    positions = anchors[:, :, None] + torch.arange(size, device=anchors.device)
    context = ((torch.arange(t, device=anchors.device)[None, None] < anchors[:, :, None])
               & attention_mask.bool()[:, None])
    context = context & real[:, :, None]  # a padding block sees only itself
    own = torch.eye(n, dtype=torch.bool, device=anchors.device).repeat_interleave(size, 0).repeat_interleave(size, 1)
    mask = torch.cat([context.repeat_interleave(size, 1), own[None].expand(b, -1, -1)], dim=-1)
    return ids.view(b, n * size), positions.view(b, n * size), mask[:, None]


@dataclass
class Slot:
    """Slot j of the blocks of a batch, at the anchors where it is scored."""

    index: int
    scored: torch.Tensor   # [B, N] bool: anchors whose slot j has a scored target (position p + j - 1)
    student: torch.Tensor  # [M, V'] the drafter's logits there
    teacher: Teacher       # the target at those positions
    labels: torch.Tensor   # [M] the tokens that followed


class DFlashModule(DistillModule):
    def __init__(self, target_model: Any, drafter: DFlashDrafter, anchors: int = 32, gamma: float = 4.0,
                 stored_layers: list[int] | None = None, step_weights: str = "decay", dpace_alpha: float = 0.5,
                 val_chunk: int = 64, seed: int = 0, consistency_passes: int = 0, consistency_weight: float = 0.0,
                 base_weight: float = 0.0, **kwargs: Any):
        super().__init__(target_model, **kwargs)
        self.consistency_passes, self.consistency_weight = consistency_passes, consistency_weight
        self.base_weight = base_weight
        self.drafter = drafter
        self.stored = (None if stored_layers is None
                       else [list(stored_layers).index(x) for x in drafter.cfg.feature_layers])
        self.size, self.anchors, self.gamma = drafter.cfg.block_size, anchors, gamma
        self.step_weights, self.dpace_alpha, self.val_chunk = step_weights, dpace_alpha, val_chunk
        self.generator = torch.Generator().manual_seed(seed)
        self.use_draft_vocab(drafter.d2t)
        # tau at distill.tau_k counts the slots a block has (past them a block drafts nothing)
        self.val_unrolled = UnrolledAcceptance(max(self.size - 1, self.tau_k))
        self.val_coverage = MeanMetric()

    def acceptance_values(self) -> dict[str, torch.Tensor]:
        return self.val_unrolled.compute()

    def _slots(self, batch: dict[str, torch.Tensor], features: torch.Tensor, teacher: Teacher, anchors: torch.Tensor,
               real: torch.Tensor, rounds: int | None = None
               ) -> list[Slot] | tuple[list[Slot], list[list[Slot]], list[Slot]]:
        """Slot j's logits where it is scored. With a refiner and `rounds` given (training), also those of each of
        `rounds` free-running rounds and of the block without the refiner's bias: (slots, rounds' slots, base)."""
        mask = batch["loss_mask"]
        b, t = mask.shape
        row = mask.flatten().cumsum(0).view_as(mask) - 1  # (b, position) -> the teacher's row
        positions = torch.arange(t, device=features.device)[None].expand(b, t)
        ids, pos, attn = block_inputs(batch["input_ids"], batch["attention_mask"], anchors, real, self.size)
        states = self.drafter(ids, pos, self.drafter.context(features, positions), attn)
        states = states.view(b, -1, self.size, states.shape[-1])
        at = {j: (anchors + j - 1).clamp(max=t - 1) for j in range(1, self.size)}  # slot j is scored at p + j - 1
        scored = {j: real & (anchors + j - 1 < t) & mask.gather(1, at[j]) for j in range(1, self.size)}

        def slots(logits_of: Any) -> list[Slot]:
            return [Slot(j, scored[j], logits_of(j).float(), teacher.select(row.gather(1, at[j])[scored[j]]),
                         batch["labels"].gather(1, at[j])[scored[j]]) for j in range(1, self.size)]

        if not self.drafter.cfg.refiner_rank:
            # x_{p+j-1}: the Markov head's input
            return slots(lambda j: self.drafter.logits(states[:, :, j][scored[j]],
                                                       batch["input_ids"].gather(1, at[j])[scored[j]]))
        # the token before each slot: slot 0's is the anchor's predecessor (the anchor itself at position 0)
        before = torch.stack([batch["input_ids"].gather(1, (anchors - 1).clamp(min=0))]
                             + [batch["input_ids"].gather(1, at[j]) for j in range(1, self.size)], dim=-1)
        flat = states.flatten(0, 1)
        logits = self.drafter.block_logits(flat, before.flatten(0, 1)).view(*states.shape[:3], -1)
        taught = slots(lambda j: logits[:, :, j][scored[j]])
        if rounds is None:
            return taught
        free, out = logits.detach(), []
        for _ in range(rounds):  # each slot's predecessor: the previous round's argmax (slot 1's: the anchor)
            drawn = free.argmax(-1) if self.drafter.d2t is None else self.drafter.d2t[free.argmax(-1)]
            prev = torch.cat([before[..., :2], drawn[..., 1:-1]], dim=-1)
            free = self.drafter.block_logits(flat, prev.flatten(0, 1)).view(*states.shape[:3], -1)
            out.append(slots(lambda j, f=free: f[:, :, j][scored[j]]))
            free = free.detach()
        base = self.drafter.lm_head(states)
        return taught, out, slots(lambda j: base[:, :, j][scored[j]])

    def _weights(self, slots: list[Slot]) -> list[torch.Tensor | float]:
        """Each slot's weight: exp(-(j-1)/gamma), or D-PACE's per anchor from the drafter's own detached probability
        of the token that followed (0 where its draft vocabulary cannot emit it)."""
        if self.step_weights != "dpace":
            return [math.exp(-(s.index - 1) / self.gamma) for s in slots]
        confidence = [self.own_confidence(s.student, s.labels, s.scored) for s in slots]
        weights = dpace_weights(confidence, [s.scored for s in slots], self.dpace_alpha)
        return [w[s.scored] for w, s in zip(weights, slots, strict=True)]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, teacher = features_and_teacher(self, batch, self.drafter.cfg.feature_layers, self.stored,
                                                 self.drafter.cfg.hidden_size)
        anchors, real = sample_anchors(anchor_candidates(batch["loss_mask"]), self.anchors, self.generator)
        refined = self.drafter.cfg.refiner_rank and (self.consistency_passes or self.base_weight)
        out = self._slots(batch, features, teacher, anchors, real, rounds=self.consistency_passes if refined else None)
        slots, rounds, base = out if refined else (out, [], [])
        total = self._block_loss(slots, log=True)
        for free in rounds:  # XPress: the free-running rounds, the recurrence drafting solves
            total = total + self.consistency_weight / len(rounds) * self._block_loss(free)
        if base and self.base_weight:  # and the block's own logits, without the refiner's bias
            total = total + self.base_weight * self._block_loss(base)
        self.log("train/loss", total, prog_bar=True)
        return total

    def _block_loss(self, slots: list[Slot], log: bool = False) -> torch.Tensor:
        """The slots' position-weighted loss (DFlash's decay or D-PACE)."""
        total, norm = torch.zeros((), device=self.device), 0.0
        for s, w in zip(slots, self._weights(slots), strict=True):
            per_row = w if isinstance(w, torch.Tensor) else None
            loss, n = self._loss(s.student, Teacher() if self.loss.name == "ce" else s.teacher, s.labels,
                                 weights=per_row)
            scale = 1.0 if per_row is not None else w  # D-PACE weighs the slots itself
            total, norm = total + scale * loss, norm + scale
            if log:
                self.log(f"train/loss_slot{s.index}", loss, batch_size=max(n, 1))
        return total / norm

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        features, teacher = features_and_teacher(self, batch, self.drafter.cfg.feature_layers, None,
                                                 self.drafter.cfg.hidden_size)
        anchors, real = all_anchors(anchor_candidates(batch["loss_mask"]))
        for c in range(0, anchors.shape[1], self.val_chunk):
            a, r = anchors[:, c:c + self.val_chunk], real[:, c:c + self.val_chunk]
            alphas, greedies = [], []
            for s in self._slots(batch, features, teacher, a, r):
                if s.index == 1:
                    loss, n = self._loss(s.student, s.teacher, s.labels)
                    if n:
                        self.val_loss.update(loss.detach(), weight=n)
                    if self.d2t is not None and len(s.teacher.logits):
                        self.val_coverage.update(torch.softmax(s.teacher.logits, -1)[:, self.d2t].sum(-1))
                alpha, greedy = token_acceptance(s.teacher.logits, self.to_target_vocab(s.student))
                for grids, per in ((alphas, alpha), (greedies, greedy)):
                    grid = torch.zeros(s.scored.shape, device=per.device)
                    grid[s.scored] = per
                    grids.append(grid)
            self.val_unrolled.update(alphas, greedies, r)

    def extra_validation_logs(self) -> dict[str, torch.Tensor]:
        return {} if self.d2t is None else {"val/vocab_coverage": self.val_coverage.compute()}
