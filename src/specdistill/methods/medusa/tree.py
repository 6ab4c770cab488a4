"""Medusa trees: which candidates of which heads the proposer drafts (methods/medusa/proposer.py), grown from the
heads' measured accuracies (methods/medusa/training.py) and compared in the report.

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
