"""Medusa trees and the Medusa proposer.

A tree is given as Medusa `choices`: one path of candidate ranks per node, e.g. (0, 1) is "head 1's
top-1 token, then head 2's second-ranked token". A node at depth d takes its token from head d, so
every node whose path ends in rank i at depth d carries the same token; siblings differ.

The default tree is grown from measured accuracies: acc[d][i] = P(head d+1's rank-i candidate is the
target's token), on the validation data. Treating the heads as independent, a node's path is accepted
with probability prod_d acc[d][i_d], and the expected number of accepted draft tokens is the sum of
that over the tree's nodes (the accepted tokens are exactly the nodes on the accepted path). Since a
child's probability never exceeds its parent's, the `budget` nodes of highest probability form a
prefix-closed tree, and taking them best-first (a heap) gives the best tree of that size under this model.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import torch

from specdistill.decoding.loop import SamplingConfig
from specdistill.decoding.tree import DraftTree

Choice = tuple[int, ...]


def grow_tree(acc: Sequence[Sequence[float]], budget: int) -> list[Choice]:
    """The `budget` choices of highest path probability under `acc` [K][R], in topological order."""
    if budget < 1:
        raise ValueError(f"Medusa tree budget={budget} must be >= 1")
    depth, ranks = len(acc), len(acc[0])
    heap: list[tuple[float, Choice]] = [(-float(acc[0][i]), (i,)) for i in range(ranks)]
    heapq.heapify(heap)
    chosen: list[Choice] = []
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)  # ties: the smaller ranks first (tuples compare in order)
        chosen.append(path)
        if len(path) < depth:
            for i in range(ranks):
                heapq.heappush(heap, (neg * float(acc[len(path)][i]), (*path, i)))
    return sort_choices(chosen)


def sort_choices(choices: Sequence[Sequence[int]]) -> list[Choice]:
    return sorted({tuple(int(i) for i in c) for c in choices}, key=lambda c: (len(c), c))


def expected_accepted(choices: Sequence[Choice], acc: Sequence[Sequence[float]]) -> float:
    """E[accepted draft tokens] of a tree under independent heads (tau = 1 + this)."""
    return sum(math.prod(float(acc[d][i]) for d, i in enumerate(c)) for c in choices)


def cartesian_choices(num_heads: int, topk: int) -> list[Choice]:
    """The full tree: every combination of each head's top-k (Medusa's "cartesian product")."""
    return sort_choices(c for d in range(1, num_heads + 1) for c in itertools.product(range(topk), repeat=d))


def check_choices(choices: Sequence[Choice], num_heads: int, max_rank: int | None = None) -> None:
    """A valid prefix tree: every node's parent is in it, depths within the heads, ranks within top-k."""
    have = set(choices)
    for c in choices:
        if not 1 <= len(c) <= num_heads:
            raise ValueError(f"Medusa choice {c}: depth must be 1..{num_heads} (one head per depth)")
        if min(c) < 0 or (max_rank is not None and max(c) >= max_rank):
            raise ValueError(f"Medusa choice {c}: ranks must be in 0..{(max_rank or 1) - 1}")
        if len(c) > 1 and c[:-1] not in have:
            raise ValueError(f"Medusa choice {c}: its parent {c[:-1]} is not in the tree")


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
