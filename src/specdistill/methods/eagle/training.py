"""method=eagle / eagle1: EAGLE heads trained on the frozen target's features (methods/eagle/model.py).

Alignment (the anchor t, as in decoding): step 0 reads h_t and x_{t+1} and is scored against the
target at t+1 (its distribution over x_{t+2}); step i (training-time test, EAGLE-3) reads the head's
own step-(i-1) state and x_{t+i+1}, sits at position t+i, and is scored against the target at t+i+1.
A step counts at anchor t when position t+i+1 is a scored position (its next token is a response
token). All anchors of a batch run in parallel: step i's queries see the step-0 entries of
positions <= t (causal) and their own anchor's entries of steps 1..i (a diagonal per step), which
is exactly what the head sees while drafting (`methods/eagle/proposer.py`; tested equal).

Teacher: live (the frozen target runs on every batch) or, with distill.teacher=precomputed, the features
stage's store (core/data/features.py): the same states and the target's top-k, read instead of computed.
Validation always runs the target live.

Loss: eagle3 sum_i decay^i D(p_{t+i+1} || q_i) with D from the registry (the target renormalised over
the draft vocabulary); eagle1 SmoothL1 between the predicted and the target's unit-RMS state at t+1
plus ce_weight * D through the target's frozen LM head, with uniform noise on the input features.
Validation unrolls max(ttt_steps, tau_k) steps: val/alpha_pos{k} and val/tau_sim over the full
vocabulary, and val/vocab_coverage, the target's probability mass inside the draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchmetrics import MeanMetric
from transformers import DynamicCache

from specdistill.methods.eagle.model import EagleHead, unit_rms
from specdistill.training.base import DistillModule, features_and_teacher
from specdistill.training.losses import Teacher, dpace_weights
from specdistill.training.metrics import UnrolledAcceptance, token_acceptance


def step_pairs(mask: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step i: anchors t [B, T] with t+i+1 scored, and those scored positions t+i+1 [B, T], same order."""
    shift = i + 1
    valid = mask[:, shift:]
    anchors = torch.nn.functional.pad(valid, (0, shift))
    return anchors, torch.nn.functional.pad(valid, (shift, 0))


def ttt_mask(attention_mask: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, T * (step + 1)] additive mask of step `step`: block 0 causal over real keys (a query
    always sees itself), block j >= 1 the same anchor's step-j entry only."""
    b, t = attention_mask.shape
    idx = torch.arange(t, device=attention_mask.device)
    causal = idx[None, :] <= idx[:, None]
    block0 = causal[None] & (attention_mask.bool()[:, None, :]
                             | torch.eye(t, dtype=torch.bool, device=idx.device)[None])
    blocks = [block0] + [torch.eye(t, dtype=torch.bool, device=idx.device)[None].expand(b, t, t)] * step
    visible = torch.cat(blocks, dim=-1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=idx.device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None]


def unroll(head: EagleHead, features: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
           steps: int, noise: float = 0.0, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The predicted states [B, T, H] of steps 0..steps-1 at every anchor, all anchors in parallel
    (`head.logits(state)` gives a step's distribution: training takes it at the scored anchors only)."""
    b, t = input_ids.shape
    hidden = head.features_in(features)
    if noise > 0:
        hidden = hidden + (torch.rand(hidden.shape, generator=generator,
                                      device=hidden.device) * 2 - 1).to(hidden.dtype) * noise
    cache = DynamicCache()
    positions = torch.arange(t, device=input_ids.device)[None].expand(b, t)
    outs = []
    for i in range(steps):
        tokens = torch.nn.functional.pad(input_ids[:, i + 1:], (0, i + 1))  # x_{t+i+1} at anchor t (0 past the end)
        mask = ttt_mask(attention_mask, i, hidden.dtype if hidden.is_floating_point() else torch.float32)
        hidden = head.advance(hidden, tokens, positions + i, mask, cache)
        outs.append(hidden)
    return outs


@dataclass
class UnrolledStep:
    """Step `index` of a training-time-test unroll, at the anchors it scores."""

    index: int
    anchors: torch.Tensor  # [B, T] bool: anchors t whose step-i prediction has a scored target (t + i + 1)
    scored: torch.Tensor   # [B, T] bool: those targets' positions
    student: torch.Tensor  # [N, V'] the head's logits at the anchors (V': its draft vocabulary)
    teacher: Teacher       # the target at the scored positions: live logits [N, V] or the stored top-k
    labels: torch.Tensor   # [N] the tokens that followed there
    states: torch.Tensor   # [B, T, H] the head's predicted states at every anchor (what the next step reads)
    features: torch.Tensor  # [B, T, F] the target features the unroll started from


class EagleModule(DistillModule):
    def __init__(self, target_model: Any, head: EagleHead, ttt_steps: int = 3, step_decay: float = 0.8,
                 feature_weight: float = 1.0, ce_weight: float = 0.1, noise: float = 0.0,
                 stored_layers: list[int] | None = None, step_weights: str = "decay", dpace_alpha: float = 0.5,
                 **kwargs: Any):
        super().__init__(target_model, **kwargs)
        # distill.teacher=precomputed: train batches carry the features stage's states of `stored_layers`
        self.stored = None if stored_layers is None else [list(stored_layers).index(x) for x in head.cfg.feature_layers]
        if ttt_steps < 1 or not 0 < step_decay <= 1:
            raise ValueError(f"eagle ttt_steps={ttt_steps} must be >= 1 and step_decay={step_decay} in (0, 1]")
        self.head = head
        self.variant = head.cfg.variant
        self.ttt_steps, self.step_decay = ttt_steps, step_decay
        self.step_weights, self.dpace_alpha = step_weights, dpace_alpha
        self.feature_weight, self.ce_weight, self.noise = feature_weight, ce_weight, noise
        self.use_draft_vocab(head.d2t)
        self.val_steps = max(ttt_steps, self.tau_k)
        self.val_unrolled = UnrolledAcceptance(self.val_steps)
        self.val_coverage = MeanMetric()

    def acceptance_values(self) -> dict[str, torch.Tensor]:
        return self.val_unrolled.compute()

    @torch.no_grad()
    def _target_pass(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Teacher]:
        return features_and_teacher(self, batch, self.head.cfg.feature_layers, self.stored, self.head.cfg.hidden_size)

    def _steps(self, batch: dict[str, torch.Tensor], steps: int, noise: float) -> Iterator[UnrolledStep]:
        mask = batch["loss_mask"]
        features, teacher = self._target_pass(batch)
        row = mask.flatten().cumsum(0).view_as(mask) - 1
        outs = unroll(self.head, features, batch["input_ids"], batch["attention_mask"], steps, noise)
        for i, out in enumerate(outs):
            anchors, scored = step_pairs(mask, i)
            yield UnrolledStep(i, anchors, scored, self.head.logits(out[anchors]).float(), teacher.select(row[scored]),
                               batch["labels"][scored], out, features)

    def _dpace(self, steps: list[UnrolledStep]) -> list[torch.Tensor]:
        """Each step's D-PACE weight at its anchors (in the order of its rows), from the head's own detached
        probability of the token that followed (0 where its draft vocabulary cannot emit it)."""
        confidence = [self.own_confidence(s.student, s.labels, s.anchors) for s in steps]
        valid = [s.anchors for s in steps]
        return [w[s.anchors] for w, s in zip(dpace_weights(confidence, valid, self.dpace_alpha), steps, strict=True)]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        steps = list(self._steps(batch, self.ttt_steps, self.noise))
        per_anchor = self._dpace(steps) if self.step_weights == "dpace" else [None] * len(steps)
        for s, w in zip(steps, per_anchor, strict=True):
            loss, n = self._loss(s.student, Teacher() if self.loss.name == "ce" else s.teacher, s.labels, weights=w)
            decay = 1.0 if w is not None else self.step_decay ** s.index  # D-PACE weighs the steps itself
            weight = decay * (self.ce_weight if self.variant == "eagle1" else 1.0)
            total = total + weight * loss
            self.log(f"train/loss_step{s.index}", loss, batch_size=max(n, 1))
            if self.variant == "eagle1" and s.index == 0 and self.feature_weight > 0 and s.anchors.any():
                # the target's own state one position on, scale-free (see methods/eagle/model.py)
                feat = torch.nn.functional.smooth_l1_loss(s.states[s.anchors].float(), unit_rms(s.features[s.scored]))
                total = total + self.feature_weight * feat
                self.log("train/feature_loss", feat, batch_size=int(s.anchors.sum()))
        self.log("train/loss", total, prog_bar=True)
        return total

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        alphas, greedies, start = [], [], None
        for s in self._steps(batch, self.val_steps, 0.0):
            teacher = s.teacher.logits
            if s.index == 0:
                start = s.anchors
                loss, n = self._loss(s.student, s.teacher, s.labels)
                if n:
                    self.val_loss.update(loss.detach(), weight=n)
                if self.d2t is not None and len(teacher):
                    self.val_coverage.update(torch.softmax(teacher, -1)[:, self.d2t].sum(-1))
            alpha, greedy = token_acceptance(teacher, self.to_target_vocab(s.student))
            for grids, per in ((alphas, alpha), (greedies, greedy)):
                grid = torch.zeros(s.anchors.shape, device=per.device)
                grid[s.anchors] = per
                grids.append(grid)
        # anchors of step i are a subset of step 0's (the response is contiguous): chains stop at its end
        self.val_unrolled.update(alphas, greedies, start)

    def extra_validation_logs(self) -> dict[str, torch.Tensor]:
        return {} if self.d2t is None else {"val/vocab_coverage": self.val_coverage.compute()}
