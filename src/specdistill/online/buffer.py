"""A bounded buffer of served requests and the batches an online update trains on.

Bounded in tokens (the memory a long deployment may hold): the oldest requests leave first. A batch
puts the loss on every rejected position of the chosen requests and on a `replay_accepted` fraction
of their accepted positions (so the draft keeps what it already does right), with the target's
stored top-k as the teacher: the batch has the generate stage's layout (`loss_mask`, `labels`,
`topk_ids`, `topk_logprobs`), so the offline Lightning modules train on it unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from specdistill.core.data.datamodule import next_token_labels
from specdistill.online.recorder import RequestRecord


class RejectionBuffer:
    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"online buffer_tokens={max_tokens} must be >= 1")
        self.max_tokens = max_tokens
        self.requests: deque[RequestRecord] = deque()
        self.tokens = 0

    def add(self, record: RequestRecord) -> None:
        if not record.positions:
            return
        self.requests.append(record)
        self.tokens += len(record.tokens)
        while self.tokens > self.max_tokens and len(self.requests) > 1:
            self.tokens -= len(self.requests.popleft().tokens)

    @property
    def rejected(self) -> int:
        return sum(r.num_rejected for r in self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def batch(self, size: int, replay_accepted: float, pad_id: int, generator: torch.Generator,
              max_length: int = 1024, skip_newest: int = 0) -> dict[str, torch.Tensor] | None:
        """`size` requests drawn without replacement, leaving out the `skip_newest` latest (an update's gate);
        None if no position is chosen."""
        pool = len(self.requests) - skip_newest
        if pool < 1:
            return None
        pick = torch.randperm(pool, generator=generator)[:size].tolist()
        return self._collate([self.requests[i] for i in pick], pad_id, max_length,
                             lambda ok: not ok or float(torch.rand((), generator=generator)) < replay_accepted)

    def newest(self, n: int, pad_id: int, max_length: int = 1024) -> dict[str, torch.Tensor] | None:
        """The latest `n` requests with every judged position in the loss mask: what an update is checked on."""
        if n < 1 or not self.requests:
            return None
        return self._collate(list(self.requests)[-n:], pad_id, max_length, lambda ok: True)

    @staticmethod
    def _collate(rows: list[RequestRecord], pad_id: int, max_length: int,
                 keep: Callable[[bool], bool]) -> dict[str, torch.Tensor] | None:
        """The rows in the generate stage's batch layout; `keep(accepted)` decides each judged position."""
        b, t = len(rows), min(max(len(r.tokens) for r in rows), max_length)
        k = len(rows[0].topk_ids[0])
        input_ids = torch.full((b, t), pad_id, dtype=torch.long)
        attention = torch.zeros((b, t), dtype=torch.long)
        loss_mask = torch.zeros((b, t), dtype=torch.bool)
        topk_ids = torch.zeros((b, t, k), dtype=torch.long)
        topk_lp = torch.full((b, t, k), float("-inf"))
        for i, rec in enumerate(rows):
            start = max(0, len(rec.tokens) - t)  # keep the end: the served positions are in the answer
            seq = rec.tokens[start:]
            input_ids[i, :len(seq)] = torch.tensor(seq)
            attention[i, :len(seq)] = 1
            for pos, ok, ids, lp in zip(rec.positions, rec.accepted, rec.topk_ids, rec.topk_logprobs, strict=True):
                p = pos - start
                if not 0 <= p < len(seq) - 1 or not keep(ok):
                    continue
                loss_mask[i, p] = True
                topk_ids[i, p], topk_lp[i, p] = ids, lp
        if not loss_mask.any():
            return None
        return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask,
                "labels": next_token_labels(input_ids, loss_mask), "topk_ids": topk_ids, "topk_logprobs": topk_lp}
