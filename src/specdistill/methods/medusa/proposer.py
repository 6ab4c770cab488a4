"""The Medusa proposer: one draft tree per round from the heads' top-k, in the shape of Medusa `choices`
(methods/medusa/tree.py says what a choice is and how the default tree is grown)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.tree import DraftTree
from specdistill.methods.medusa.tree import check_choices, sort_choices


class MedusaProposer:
    """Drafts a fixed-shape tree from the K heads on the last committed token's target state.

    The nodes are deterministic (q = None: top-ranked tokens), so the verifier's rule for one-hot
    drafts keeps decoding lossless at any temperature (SpecInfer's multi-candidate rule).
    """

    feature_layers = ("final",)  # the normed last hidden state, what the LM head reads

    def __init__(self, heads: torch.nn.Module, choices: Sequence[Sequence[int]]):
        choices = sort_choices(choices)
        check_choices(choices, heads.num_heads)
        self.heads = heads.eval()
        self.choices = choices
        index = {c: n for n, c in enumerate(choices)}
        self.parents = torch.tensor([index[c[:-1]] if len(c) > 1 else -1 for c in choices])
        self.head_of = torch.tensor([len(c) - 1 for c in choices])  # 0-based head per node
        self.rank_of = torch.tensor([c[-1] for c in choices])
        self.topk = int(self.rank_of.max()) + 1
        self.depth = max(len(c) for c in choices)
        d2t = getattr(heads, "d2t", None)
        self.d2t = None if d2t is None else d2t.cpu()
        self.reset()

    def reset(self) -> None:
        self.hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def propose(self, context: list[int], max_depth: int, sampling: SamplingConfig,
                generator: torch.Generator | None, features: torch.Tensor | None = None) -> DraftTree | None:
        if features is not None and len(features):
            # the newest committed state is of context[-2]: its LM head gave context[-1] (the root), so
            # head k predicts the token k steps after the root, i.e. the tree's depth k
            self.hidden = features[-1]
        if self.hidden is None:
            return None
        depth = min(self.depth, max_depth)  # only the heads the tree reaches (a head is an N x H matmul)
        param = next(self.heads.parameters())
        h = self.hidden.to(param.device, param.dtype)
        logits = torch.stack([self.heads.head(k, h) for k in range(1, depth + 1)])  # [depth, N]
        top = torch.topk(logits.float(), self.topk, dim=-1).indices.cpu()  # [depth, topk]
        if self.d2t is not None:
            top = self.d2t[top]
        n = int((self.head_of < depth).sum())  # choices are sorted by length: the nodes within depth lead
        return DraftTree(top[self.head_of[:n], self.rank_of[:n]], self.parents[:n].clone())
