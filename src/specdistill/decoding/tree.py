"""Draft trees: the one shape every proposer returns (a chain is a tree with one child per node).

Node i holds `tokens[i]`, its parent `parents[i]` (-1: the root, i.e. the last emitted token, which the
target has not seen yet) and, when it was sampled, the draft distribution `q[i]` it was drawn from.
`q = None` means the nodes were chosen deterministically (top-k, argmax, prompt lookup): for the
verification rule each such node was drawn from a one-hot distribution on itself.
Nodes are in topological order (a parent comes before its children).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long, -1 for children of the root
    q: torch.Tensor | None = None  # [n, V] float, or None: deterministic (one-hot) drafts

    def __post_init__(self) -> None:
        self.tokens = self.tokens.long().cpu()
        self.parents = self.parents.long().cpu()
        if self.tokens.shape != self.parents.shape:
            raise ValueError("tokens and parents must have the same length")
        if bool((self.parents >= torch.arange(len(self.parents))).any()):
            raise ValueError("draft tree nodes must be in topological order (parent index < node index)")

    @classmethod
    def chain(cls, tokens: list[int] | torch.Tensor, q: torch.Tensor | None = None) -> DraftTree:
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        return cls(tokens, torch.arange(len(tokens)) - 1, q)

    @classmethod
    def empty(cls) -> DraftTree:
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def depth(self) -> torch.Tensor:
        """Depth of each node: 1 for children of the root."""
        d = torch.zeros(len(self), dtype=torch.long)
        for i, p in enumerate(self.parents.tolist()):
            d[i] = 1 if p < 0 else d[p] + 1
        return d

    @property
    def is_chain(self) -> bool:
        return bool(torch.equal(self.parents, torch.arange(len(self)) - 1))

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def ancestors(self) -> torch.Tensor:
        """[n+1, n+1] bool over (root, nodes...): row i sees column j iff j is i or an ancestor of i."""
        n = len(self)
        anc = torch.eye(n + 1, dtype=torch.bool)
        anc[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            anc[i + 1] |= anc[p + 1]
        return anc

    @property
    def reach(self) -> torch.Tensor:
        """Per node, the highest sibling rank on its way from the root (itself included): 0 on the path of first
        children. Rank is the order among siblings, which is the order the verifier tries them in (`verify.py`);
        most proposers here put their likelier children first (a union puts the method's before the companion's),
        so `reach < w` is the node's place in the tree's first w children per node."""
        reach = torch.zeros(len(self), dtype=torch.long)
        seen: dict[int, int] = {}  # parent -> children so far
        for i, p in enumerate(self.parents.tolist()):
            rank = seen.get(p, 0)
            seen[p] = rank + 1
            reach[i] = rank if p < 0 else max(rank, int(reach[p]))
        return reach

    def truncate(self, max_depth: int) -> DraftTree:
        """The nodes at depth <= max_depth (still topologically ordered, indices remapped)."""
        return DraftTree.empty() if max_depth <= 0 else self.prune(max_depth)

    def prune(self, max_depth: int | None = None, width: int | None = None) -> DraftTree:
        """The nodes at depth <= max_depth among the first `width` children of each node (None: no limit).
        Pruning keeps the verification lossless: siblings are tried in order, so the first `width` of them are
        tried exactly as in the whole tree, and a node's ancestors are always kept."""
        keep = torch.ones(len(self), dtype=torch.bool)
        if max_depth is not None:
            keep &= self.depth <= max_depth
        if width is not None:
            keep &= self.reach < width
        if bool(keep.all()):
            return self
        keep = keep.nonzero().flatten()
        remap = torch.full((len(self),), -1, dtype=torch.long)
        remap[keep] = torch.arange(len(keep))
        parents = torch.where(self.parents[keep] >= 0, remap[self.parents[keep].clamp(min=0)], -1)
        return DraftTree(self.tokens[keep], parents, None if self.q is None else self.q[keep])


def tree_attention(tree: DraftTree, past: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                   root: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """4D additive mask [1, 1, q, past + q] and position ids [1, q] for scoring (root,) + nodes in one forward.

    Every query sees the whole past, itself and its ancestors; positions are past + depth.
    """
    anc = tree.ancestors()
    depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
    if not root:  # score the nodes only (their root is already in the past)
        anc, depth = anc[1:, 1:], depth[1:] - 1
    q = anc.shape[0]
    visible = torch.cat([torch.ones(q, past, dtype=torch.bool), anc], dim=1)
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None].to(device), (past + depth)[None].to(device)
