"""Acceptance rules: which draft nodes the target keeps, and the token it adds.

Greedy: walk down the tree taking the child that equals the target's argmax; the bonus is the argmax
where no child matches. Sampling: recursive rejection sampling (Leviathan et al. 2023, Chen et al.
2023; over siblings as in SpecInfer, Miao et al. 2024): at a node with target distribution p, child x
drawn from q is accepted with probability min(1, p(x) / q(x)); on rejection p becomes the residual
norm(max(p - q, 0)) and the next sibling is tried against it; when no child is left the bonus is drawn
from what remains. Each step yields an exact sample of the current p, so the emitted tokens follow the
target's distribution whatever the draft. A deterministic node (q one-hot) is accepted with
probability p(x), and its residual is p with x removed.
"""

from __future__ import annotations

import torch

from specdistill.core.sampling import sample
from specdistill.decoding.tree import DraftTree


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """target_logits [n+1, V]: row 0 after the root, row i+1 after node i."""
    best = target_logits.argmax(-1).tolist()
    tokens = tree.tokens.tolist()
    path, node = [], -1
    while True:
        want = best[node + 1]
        match = next((c for c in tree.children(node) if tokens[c] == want), None)
        if match is None:
            return path, want
        path.append(match)
        node = match


def verify_sampling(tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None = None,
                    skip_residual: bool = False) -> tuple[list[int], int]:
    """p [n+1, V]: the warped target distributions. `skip_residual` breaks the rule (tests show it fails)."""
    tokens = tree.tokens.tolist()
    path, node = [], -1
    while True:
        residual = p[node + 1].double()
        accepted = None
        for c in tree.children(node):
            x = tokens[c]
            qx = 1.0 if tree.q is None else float(tree.q[c, x])
            ratio = float(residual[x]) / qx if qx > 0 else 1.0
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < min(1.0, ratio):
                accepted = c
                break
            if skip_residual:
                continue
            if tree.q is None:
                residual = residual.clone()
                residual[x] = 0.0
            else:
                residual = (residual - tree.q[c].double()).clamp_(min=0.0)
            total = residual.sum()
            residual = residual / total if total > 0 else p[node + 1].double()
        if accepted is None:
            return path, int(sample(residual, generator))
        path.append(accepted)
        node = accepted
