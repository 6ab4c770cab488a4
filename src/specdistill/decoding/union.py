"""Several drafts verified as one tree: the union of deterministic draft trees, merged on shared prefixes.

Why: a trained head and prompt lookup are right in different places. Lookup copies the spans an answer
repeats from its prompt or from an earlier turn (MT-bench's second turns rework the first answer), where a
small head is weak; the head predicts the rest. The target verifies any tree in one forward, so the union
costs one verification over the nodes of both, and accepts the longer of the two where they disagree.

Only deterministic trees merge (q = None: top-k, argmax, lookup), the case the verifier's rule keeps
lossless for any set of siblings. A sampled chain carries its own q, which a one-hot sibling cannot share.
"""

from __future__ import annotations

import torch

from specdistill.decoding.protocols import Proposer, SamplingConfig
from specdistill.decoding.tree import DraftTree


def merge(trees: list[DraftTree]) -> DraftTree:
    """The union of `trees` as a trie: a node of a later tree that repeats a (parent, token) of the union
    so far is the same node, so siblings stay distinct. The first tree's nodes keep their indices, and the
    nodes a later tree adds come after it (still topological)."""
    if any(t.q is not None for t in trees):
        raise ValueError("only deterministic draft trees (q = None) merge: a sampled chain's q cannot be shared "
                         "with other drafts' nodes; use a tree shape, or temperature 0")
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent in the union, token) -> node in the union
    for tree in trees:
        mapped: list[int] = []
        for tok, parent in zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True):
            key = (mapped[parent] if parent >= 0 else -1, tok)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(tok)
                parents.append(key[0])
            mapped.append(index[key])
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


class UnionProposer:
    """Each proposer drafts after the same context; the target verifies the merged tree. At most one of them
    may read the target's hidden states (they arrive once per round); the others get them too and ignore them."""

    def __init__(self, *proposers: Proposer):
        if len(proposers) < 2:
            raise ValueError("a union needs at least two proposers")
        layers = {tuple(p.feature_layers) for p in proposers if p.feature_layers}
        if len(layers) > 1:
            raise ValueError(f"proposers read different target states {sorted(layers)}: the verifier returns one set")
        self.proposers = proposers
        self.feature_layers = next(iter(layers), ())

    def reset(self) -> None:
        for p in self.proposers:
            p.reset()

    def propose(self, context: list[int], max_depth: int, sampling: SamplingConfig,
                generator: torch.Generator | None, features: torch.Tensor | None = None) -> DraftTree | None:
        # every proposer runs every round: a head that reads features must see each round's to stay in step
        trees = [p.propose(context, max_depth, sampling, generator, features) for p in self.proposers]
        trees = [t for t in trees if t is not None and len(t)]
        if len(trees) <= 1:
            return trees[0] if trees else None
        return merge(trees)
