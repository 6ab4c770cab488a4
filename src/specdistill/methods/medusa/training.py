"""method=medusa: Medusa-1 heads on the frozen target (backbone frozen, heads trained).

Alignment, for a batch whose loss mask marks the positions t whose next token x_{t+1} is a response
token: head k at position t reads h_t and is scored against the target's own distribution over
x_{t+k+1}, i.e. the target's logits at position t+k (soft, any divergence of the registry), or with
hard CE against the sampled token x_{t+k+1} = labels[t+k]. A pair counts when both t and t+k are
scored positions (the heads only ever draft after the last prompt token). Head k's loss is weighted
lambda_k = decay^k. One target forward per batch gives both the hidden states and the teacher.

Validation logs, per head, top-1 and top-5 accuracy against the target's top token and the expected
acceptance alpha = sum min(p, q); `val/alpha` and `val/alpha_t0` are head 1's (the first drafted
token, as for every method), and `val/tau_tree{B}` is the tau that the tree grown from these
accuracies with B nodes should reach (methods/medusa/proposer.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from specdistill.methods.medusa.model import MedusaHeads
from specdistill.methods.medusa.tree import expected_accepted, grow_tree
from specdistill.training.base import DistillModule
from specdistill.training.losses import Teacher
from specdistill.training.metrics import HeadAccuracy


def head_pairs(mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For head k: `source` [B, T] bool (positions t it drafts from) and `shifted` [B, T] bool (t + k),
    both True exactly for the pairs where t and t + k are scored positions, in the same row-major order."""
    valid = mask[:, :-k] & mask[:, k:] if mask.shape[1] > k else mask[:, :0]
    source = torch.nn.functional.pad(valid, (0, mask.shape[1] - valid.shape[1]))
    shifted = torch.nn.functional.pad(valid, (mask.shape[1] - valid.shape[1], 0))
    return source, shifted


class MedusaModule(DistillModule):
    def __init__(self, target_model: Any, heads: MedusaHeads, decay: float = 0.8, max_rank: int = 10,
                 tree_budgets: Sequence[int] = (16, 32, 64), **kwargs: Any):
        super().__init__(target_model, **kwargs)
        if not 0 < decay <= 1:
            raise ValueError(f"medusa decay={decay} must be in (0, 1]")
        self.heads = heads
        self.decay = decay
        self.tree_budgets = list(tree_budgets)
        self.use_draft_vocab(heads.d2t)
        self.val_heads = HeadAccuracy(heads.num_heads, max_rank)
        self.accuracy: torch.Tensor | None = None  # [K, max_rank] of the last validation pass

    @torch.no_grad()
    def _target_pass(self, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h [B, T, H] after the final norm, the target's logits [N, V] at the N scored positions)."""
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.target.get_decoder()(input_ids=batch["input_ids"],
                                               attention_mask=batch["attention_mask"]).last_hidden_state
            return hidden, self.target.get_output_embeddings()(hidden[mask]).float()
        return self.target_pass_once(run)

    def head_batches(self,
                     batch: dict[str, torch.Tensor]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(k, h_t [n, H], the target's logits at t + k [n, V], x_{t+k+1} [n]) for every head k."""
        mask = batch["loss_mask"]
        hidden, teacher = self._target_pass(batch, mask)
        row = mask.flatten().cumsum(0).view_as(mask) - 1  # row of a scored position in `teacher`
        for k in range(1, self.heads.num_heads + 1):
            source, shifted = head_pairs(mask, k)
            yield k, hidden[source], teacher[row[shifted]], batch["labels"][shifted]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for k, h, t_logits, labels in self.head_batches(batch):
            teacher = Teacher() if self.loss.name == "ce" else Teacher(logits=t_logits)
            loss, n = self._loss(self.heads.head(k, h), teacher, labels)
            total = total + self.decay ** k * loss
            self.log(f"train/loss_head{k}", loss, batch_size=max(n, 1))
        self.log("train/loss", total, prog_bar=True)
        return total

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        for k, h, t_logits, labels in self.head_batches(batch):
            s_logits = self.heads.head(k, h)
            loss, n = self._loss(s_logits, Teacher(logits=t_logits), labels)
            if n:
                self.val_loss.update(loss.detach(), weight=n)
            self.val_heads.update(k, t_logits, self.to_target_vocab(s_logits))

    def acceptance_values(self) -> dict[str, torch.Tensor]:
        """Head 1's acceptance as `alpha` / `alpha_t0` (the draft's next token, as the other methods' first
        position), beside every head's figures; the rank matrix `acc` stays with the epoch end."""
        values = {k: v for k, v in self.val_heads.compute().items() if k != "acc"}
        return {"alpha": values["head1_alpha"], "alpha_t0": values["head1_top1"], **values}

    def on_validation_epoch_end(self) -> None:
        values = self.val_heads.compute()  # synced across ranks (sums)
        self.val_heads.reset()
        acc = values.pop("acc").double().cpu()
        logged = {"val/loss": self.val_loss.compute().double().cpu(), "val/alpha": values["head1_alpha"],
                  "val/alpha_t0": values["head1_top1"]}
        self.val_loss.reset()
        logged.update({f"val/{k}": v for k, v in values.items()})
        chain = [(0,) * d for d in range(1, min(self.tau_k, len(acc)) + 1)]  # top-1 of each head: a chain at T=0
        logged["val/tau_sim_t0"] = torch.tensor(1 + expected_accepted(chain, acc.tolist()))
        for b in self.tree_budgets:
            logged[f"val/tau_tree{b}"] = torch.tensor(1 + expected_accepted(grow_tree(acc.tolist(), b), acc.tolist()))
        self.accuracy = acc
        self.log_validation(logged)

    def trees(self) -> dict[str, Any]:
        """The trees saved beside the heads: grown from the last validation pass's accuracies."""
        if self.accuracy is None:
            raise RuntimeError("no validation pass yet: the trees are grown from measured accuracies")
        acc = self.accuracy.tolist()
        out: dict[str, Any] = {"acc": [[round(a, 6) for a in row] for row in acc], "trees": {}}
        for b in self.tree_budgets:
            choices = grow_tree(acc, b)
            out["trees"][str(b)] = {"choices": [list(c) for c in choices],
                                    "expected_tau": round(1 + expected_accepted(choices, acc), 4)}
        return out
