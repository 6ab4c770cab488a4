"""Prompt lookup (Saxena 2023): the draft is what followed the longest recent n-gram match in the context.

Trains nothing; `branches` > 1 drafts several matches as sibling chains of one tree."""

from __future__ import annotations

import torch

from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.tree import DraftTree


class PromptLookupProposer:
    feature_layers = ()
    def __init__(self, k: int = 8, max_ngram: int = 3, min_ngram: int = 1, branches: int = 1):
        if branches < 1:
            raise ValueError(f"branches={branches}: the lookup tree needs at least one chain")
        self.k, self.max_ngram, self.min_ngram, self.branches = k, max_ngram, min_ngram, branches

    def reset(self) -> None:
        pass

    def propose(self, context: list[int], max_depth: int, sampling: SamplingConfig,
                generator: torch.Generator | None, features: torch.Tensor | None = None) -> DraftTree | None:
        k = min(self.k, max_depth)
        chains: list[list[int]] = []
        firsts: set[int] = set()
        # longest n-gram first, and for each its latest earlier occurrence first: the best single guess leads,
        # and each further chain must start with a token no chain before it starts with (else it would
        # mostly repeat a path the tree already holds)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + k]
                    if follow and follow[0] not in firsts:
                        chains.append(follow)
                        firsts.add(follow[0])
                        if len(chains) == self.branches:
                            return _siblings(chains)
        return _siblings(chains) if chains else None


def _siblings(chains: list[list[int]]) -> DraftTree:
    """Chains with distinct first tokens as children of the root, one after another (topological order)."""
    tokens: list[int] = []
    parents: list[int] = []
    for chain in chains:
        first = len(tokens)
        tokens.extend(chain)
        parents.extend([-1] + list(range(first, first + len(chain) - 1)))
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
