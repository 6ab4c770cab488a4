"""method=draft: a separate small causal LM distilled from the target's next-token distribution.

A reduced draft vocabulary (`d2t`) is handled by the base (`DistillModule.use_draft_vocab`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdistill.training.base import DistillModule, logits_at
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
        self.use_draft_vocab(getattr(draft, "d2t", None))

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
