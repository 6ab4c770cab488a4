"""method=draft: a separate small causal LM distilled from the target's next-token distribution.

With a reduced draft vocabulary (`d2t`, draft id -> target id) the loss compares the student with the
target renormalised over the draft's tokens (hard targets outside it are dropped), while validation
scatters the student back to the full vocabulary: `val/alpha` counts the mass the draft cannot
propose as lost, exactly as the decoder will.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdistill.training.base import DistillModule, logits_at
from specdistill.training.losses import Teacher
from specdistill.training.onpolicy import continue_prompts


@dataclass
class OnPolicy:
    """DistillSpec data: with probability `fraction` per step the draft samples the batch's answers."""

    fraction: float
    max_new_tokens: int
    stops: set[int]
    pad_id: int
    seed: int = 0


class DraftLMModule(DistillModule):
    def __init__(self, target_model: Any, draft: Any, onpolicy: OnPolicy | None = None, **kwargs: Any):
        super().__init__(target_model, **kwargs)
        self.draft = draft
        self.onpolicy = onpolicy
        d2t = getattr(draft, "d2t", None)
        vocab = target_model.get_output_embeddings().weight.shape[0]
        self.register_buffer("d2t", None if d2t is None else d2t.long())
        if d2t is not None:
            t2d = torch.full((vocab,), -1, dtype=torch.long)
            t2d[d2t] = torch.arange(len(d2t))
            self.register_buffer("t2d", t2d, persistent=False)

    def on_policy(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cfg = self.onpolicy
        if cfg is None or cfg.fraction <= 0:
            return batch
        # one draw per (seed, rank, step): a resumed run makes the same choices and samples
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.global_rank * 7_919 + self.global_step)
        if float(torch.rand((), generator=g)) >= cfg.fraction:
            return batch
        return continue_prompts(self.draft, batch, cfg.max_new_tokens, cfg.stops, cfg.pad_id, self.d2t,
                                g if batch["input_ids"].device.type == "cpu" else None)

    def student_logits(self, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        return logits_at(self.draft, batch, mask)

    def to_target_vocab(self, student_logits: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return student_logits
        full = student_logits.new_full((student_logits.shape[0], self.t2d.shape[0]), float("-inf"))
        full[:, self.d2t] = student_logits
        return full

    def teacher_in_student_vocab(self, teacher: Teacher, targets: torch.Tensor) -> tuple[Teacher, torch.Tensor]:
        if self.d2t is None:
            return teacher, targets
        targets = torch.where(self.t2d[targets] >= 0, self.t2d[targets], torch.full_like(targets, -100))
        if teacher.topk_ids is not None:  # stored top-k: dense log-probs, ids outside the draft get none
            teacher = Teacher(logits=teacher.log_probs(1.0, self.t2d.shape[0]))
        if teacher.logits is not None:
            return Teacher(logits=teacher.logits[:, self.d2t]), targets
        return teacher, targets
