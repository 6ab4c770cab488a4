"""method=draft: a separate small causal LM distilled from the target's next-token distribution.

With a reduced draft vocabulary (`d2t`, draft id -> target id) the loss compares the student with the
target renormalised over the draft's tokens (hard targets outside it are dropped), while validation
scatters the student back to the full vocabulary: `val/alpha` counts the mass the draft cannot
propose as lost, exactly as the decoder will.
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.training.base import DistillModule, logits_at
from specdistill.training.losses import Teacher


class DraftLMModule(DistillModule):
    def __init__(self, target_model: Any, draft: Any, **kwargs: Any):
        super().__init__(target_model, **kwargs)
        self.draft = draft
        d2t = getattr(draft, "d2t", None)
        vocab = target_model.get_output_embeddings().weight.shape[0]
        self.register_buffer("d2t", None if d2t is None else d2t.long())
        if d2t is not None:
            t2d = torch.full((vocab,), -1, dtype=torch.long)
            t2d[d2t] = torch.arange(len(d2t))
            self.register_buffer("t2d", t2d, persistent=False)

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
