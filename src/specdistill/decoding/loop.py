"""The speculative generate loop (batch size 1, the standard protocol) and its accounting.

Every round is one target forward: the proposer drafts a tree, the target scores it, the rule keeps a
path and adds one token. Without a proposer the same loop is plain autoregressive decoding (tau = 1),
which is the baseline measured in the same process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdistill.core.sampling import sample_logits, warp
from specdistill.decoding.protocols import Proposer, SamplingConfig, Verifier
from specdistill.decoding.tree import DraftTree
from specdistill.decoding.verify import verify_greedy, verify_sampling


@dataclass
class RoundStats:
    draft_len: int  # nodes in the draft
    draft_depth: int
    accepted: int  # draft tokens kept
    emitted: int  # tokens added to the output this round (accepted + 1, less any cut at a stop)
    draft_s: float
    verify_s: float
    # at the first draft position, from the two distributions (docs/definitions.md: alpha = sum min(p, q)):
    alpha_exact: float | None = None  # expected acceptance of the first drafted token
    kl: float | None = None  # KL(p || q) there (inf where q misses p's support)


@dataclass
class GenerationResult:
    tokens: list[int]
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_s: float = 0.0

    @property
    def target_forwards(self) -> int:
        return len(self.rounds) + 1  # + the prefill, which emits the first token

    @property
    def tau(self) -> float:
        return len(self.tokens) / self.target_forwards

    def first_position(self) -> tuple[list[float], list[float]]:
        """(alpha_exact, KL) of every round that drafted a sampled first token."""
        rounds = [r for r in self.rounds if r.alpha_exact is not None]
        return [r.alpha_exact for r in rounds], [r.kl for r in rounds if r.kl is not None]

    def acceptance_counts(self, max_pos: int) -> tuple[list[int], list[int]]:
        """(attempts, accepts) at draft positions 1..max_pos: position k counts when 1..k-1 were accepted."""
        attempts, accepts = [0] * max_pos, [0] * max_pos
        for r in self.rounds:
            for k in range(min(r.draft_depth, max_pos)):
                if r.accepted >= k:
                    attempts[k] += 1
                    accepts[k] += int(r.accepted > k)
        return attempts, accepts


def alpha_and_kl(p: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """sum min(p, q) (= 1 - TV with TV half the L1 distance) and KL(p || q), in float64."""
    p, q = p.double(), q.double()
    alpha = float(torch.minimum(p, q).sum())
    support = p > 0
    if bool((q[support] <= 0).any()):
        return alpha, float("inf")
    return alpha, float((p[support] * (p[support] / q[support]).log()).sum())


def speculative_generate(verifier: Verifier, proposer: Proposer | None, prompt: list[int], max_new_tokens: int,
                         stops: set[int], sampling: SamplingConfig = SamplingConfig(),
                         generator: torch.Generator | None = None) -> GenerationResult:
    t0 = time.perf_counter()
    logits = verifier.prefill(prompt)
    out = [int(sample_logits(logits, sampling.temperature, sampling.top_p, sampling.top_k, generator))]
    features = verifier.features
    result = GenerationResult(out, prefill_s=time.perf_counter() - t0)
    if proposer is not None:
        proposer.reset()
    while out[-1] not in stops and len(out) < max_new_tokens:
        t0 = time.perf_counter()
        depth_budget = max_new_tokens - len(out) - 1  # accepted + bonus must fit
        tree = None
        if proposer is not None and depth_budget > 0:
            tree = proposer.propose(prompt + out, depth_budget, sampling, generator, features)
        if tree is not None and len(tree) and int(tree.depth.max()) > depth_budget:
            tree = tree.truncate(depth_budget)
        t1 = time.perf_counter()
        logits = verifier.score(out[-1], tree)
        tree = tree if tree is not None else DraftTree.empty()
        alpha_exact = kl = None
        if sampling.greedy:
            path, bonus = verify_greedy(tree, logits)
        else:
            p = warp(logits, sampling.temperature, sampling.top_p, sampling.top_k)
            if tree.q is not None and len(tree):
                alpha_exact, kl = alpha_and_kl(p[0], tree.q[tree.children(-1)[0]])
            path, bonus = verify_sampling(tree, p, generator)
        verifier.commit(path)
        features = verifier.features
        new = [int(tree.tokens[i]) for i in path] + [bonus]
        cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
        out.extend(new[:cut])
        depth = int(tree.depth.max()) if len(tree) else 0
        result.rounds.append(RoundStats(len(tree), depth, len(path), cut, t1 - t0, time.perf_counter() - t1,
                                        alpha_exact, kl))
    del out[max_new_tokens:]
    return result
