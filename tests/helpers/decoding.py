"""Bigram targets and proposers, whose output law is known in closed form, and greedy references.

A bigram target's next-token logits depend on the last token only, so the exact marginal distribution of every
generated position is the first token's warped distribution times the warped transition matrix (`exact_marginals`).
"""

from __future__ import annotations

import functools

import torch

from specdistill.core.sampling import sample, warp
from specdistill.decoding.tree import DraftTree

V = 8  # bigram vocabulary


def tables(seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * 1.5
    draft = torch.randn(V, V, generator=g) * 1.5  # deliberately unrelated to the target
    return target, draft


def exact_marginals(table, first_logits, sampling, steps):
    P = warp(table, sampling.temperature, sampling.top_p, sampling.top_k).double()
    m = warp(first_logits, sampling.temperature, sampling.top_p, sampling.top_k).double()
    out = [m]
    for _ in range(steps - 1):
        m = m @ P
        out.append(m)
    return out


class BigramProposer:
    """Chain: K tokens sampled from the draft table. Tree: per depth, i.i.d. samples or top-b (deterministic)."""

    def __init__(self, table, k=3, branching=None, iid=False):
        self.table, self.k, self.branching, self.iid = table, k, branching, iid

    def reset(self):
        pass

    def propose(self, context, max_depth, sampling, generator, features=None):
        warp_ = functools.partial(warp, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if self.branching is None:
            toks, qs, last = [], [], context[-1]
            for _ in range(min(self.k, max_depth)):
                q = warp_(self.table[last])
                last = int(sample(q, generator))
                toks.append(last)
                qs.append(q)
            return DraftTree.chain(toks, torch.stack(qs))
        toks, parents, qs, frontier = [], [], [], [(-1, context[-1])]
        for b in self.branching[:max_depth]:
            nxt = []
            for node, tok in frontier:
                q = warp_(self.table[tok])
                picks = [int(sample(q, generator)) for _ in range(b)] if self.iid else torch.topk(q, b).indices.tolist()
                for x in picks:
                    toks.append(x)
                    parents.append(node)
                    qs.append(q)
                    nxt.append((len(toks) - 1, x))
            frontier = nxt
        return DraftTree(torch.tensor(toks), torch.tensor(parents), torch.stack(qs) if self.iid else None)


class FeatureBigramVerifier:
    """A bigram target (`tables`) whose 'hidden state' of a token is its one-hot vector."""

    def __init__(self, table):
        self.table, self.features, self._scored = table, None, None

    def prefill(self, ids):
        self.features = torch.eye(V)[torch.tensor(ids)]
        return self.table[ids[-1]]

    def score(self, root, tree):
        self._scored = torch.tensor([root] + (tree.tokens.tolist() if tree is not None else []))
        return self.table[self._scored]

    def commit(self, path):
        self.features = torch.eye(V)[self._scored[[0] + [i + 1 for i in path]]]


PROMPTS = [[1, 5, 9, 13, 40, 41], [1, 77, 3, 12], [1, 200, 201, 202, 203, 204, 205, 206]]


def plain_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=2,
                         eos_token_id=None)
    return out[0, len(prompt):].tolist()


def tree_paths(tree) -> set[tuple[int, ...]]:
    """Every node of a draft tree as its token path from the root."""
    paths: list[tuple[int, ...]] = []
    for tok, parent in zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True):  # parents come first
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
    return set(paths)
