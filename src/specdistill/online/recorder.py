"""What a verification round tells us for free: where the draft was right, where it was wrong, and the
target's distribution at each of those positions (Liu et al. 2023, "Online Speculative Decoding").

`RecordingVerifier` wraps the decoder's verifier. After every commit it records, for the position of
each accepted draft token and for the first rejected one, the target's distribution there (the row
of the logits the verifier already computed) as its top-k log-probabilities. Positions index the
request's final sequence (prompt + output): position t holds the target's distribution of token
t+1 given tokens[: t + 1], as the training data's loss positions do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specdistill.decoding.tree import DraftTree


@dataclass
class RequestRecord:
    """One served request: its tokens and the judged draft positions with the target's top-k there."""

    tokens: list[int] = field(default_factory=list)  # prompt + committed tokens (the final sequence once done)
    prompt_len: int = 0
    positions: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)  # [k] each
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def num_rejected(self) -> int:
        return len(self.accepted) - self.num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over judged ones (each round: its accepted tokens and at most one rejection)."""
        return self.num_accepted / len(self.accepted) if self.accepted else 0.0

    def finish(self, output: list[int]) -> RequestRecord:
        """Cut to the emitted output (a stop token or max_new_tokens may end it inside a round)."""
        self.tokens = self.tokens[: self.prompt_len] + list(output)
        keep = [i for i, t in enumerate(self.positions) if t + 1 < len(self.tokens)]
        for name in ("positions", "accepted", "topk_ids", "topk_logprobs"):
            values = getattr(self, name)
            if values:  # the top-k lists are empty when the server was not learning
                setattr(self, name, [values[i] for i in keep])
        return self


class RecordingVerifier:
    """A verifier (`decoding.loop.Verifier`) that also keeps a `RequestRecord` of every request."""

    def __init__(self, inner: Any, topk: int = 256):
        self.inner, self.topk = inner, topk
        self.keep_topk = True  # False: judge the draft only (a server that is not learning needs no teacher)
        self.record = RequestRecord()
        self._root: int | None = None
        self._tree: DraftTree | None = None
        self._logits: torch.Tensor | None = None

    @property
    def features(self) -> torch.Tensor | None:
        return self.inner.features

    def prefill(self, ids: list[int]) -> torch.Tensor:
        self.record = RequestRecord(tokens=list(ids), prompt_len=len(ids))
        return self.inner.prefill(ids)

    def score(self, root: int, tree: DraftTree | None) -> torch.Tensor:
        self._root, self._tree = root, tree
        self._logits = self.inner.score(root, tree)
        return self._logits

    def _keep(self, position: int, row: int, accepted: bool) -> None:
        self.record.positions.append(position)
        self.record.accepted.append(accepted)
        if self.keep_topk:
            top = torch.topk(torch.log_softmax(self._logits[row].float(), -1), self.topk)
            self.record.topk_ids.append(top.indices.cpu())
            self.record.topk_logprobs.append(top.values.cpu())

    def commit(self, path: list[int]) -> None:
        tree, rec = self._tree, self.record
        root_pos = len(rec.tokens)  # the root is the next committed token
        row = 0  # the logits row that judged the next draft position: the root's, then each accepted node's
        for depth, node in enumerate(path):
            self._keep(root_pos + depth, row, accepted=True)
            row = node + 1
        last = path[-1] if path else -1
        if tree is not None and len(tree) and tree.children(last):  # the draft proposed more here: rejected
            self._keep(root_pos + len(path), row, accepted=False)
        self.inner.commit(path)
        rec.tokens.append(self._root)
        rec.tokens.extend(int(tree.tokens[i]) for i in path)
