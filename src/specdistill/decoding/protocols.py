"""What the decoding loop calls and what drafts for it: the sampling settings, a proposer (anything that drafts a
tree after a context) and a verifier (the target scoring a tree). Proposers and verifiers import these, not the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdistill.core.sampling import sample, warp
from specdistill.decoding.tree import DraftTree


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def draft_token(logits: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """A chain proposer's next token: the argmax at temperature 0, else a sample from the warped
    distribution q, which the verifier needs (returned) for the acceptance rule."""
    if sampling.greedy:
        return int(logits.argmax()), None
    q = warp(logits, sampling.temperature, sampling.top_p, sampling.top_k)
    return int(sample(q, generator)), q


class Proposer(Protocol):
    """Drafts a tree after `context`. Heads that read the target's hidden states name them in
    `feature_layers` (indices as in `core/models/hidden.py`); `features` then holds those states for the
    context tokens committed since the previous call: the target states of context[:-1] arrive in
    order across calls (row i predicted the token after it), the last token's state comes next round."""

    feature_layers: tuple = ()

    def reset(self) -> None: ...

    def propose(self, context: list[int], max_depth: int, sampling: SamplingConfig,
                generator: torch.Generator | None, features: torch.Tensor | None = None) -> DraftTree | None: ...


class Verifier(Protocol):
    features: torch.Tensor | None  # hidden states of the tokens the last prefill/commit kept

    def prefill(self, ids: list[int]) -> torch.Tensor: ...

    def score(self, root: int, tree: DraftTree | None) -> torch.Tensor: ...

    def commit(self, path: list[int]) -> None: ...
