"""`eval.depth=auto`: the draft depth that maximises expected tokens/s on this machine, from measured costs.

A speed-up is tau over what a round costs in plain decode steps, and both halves depend on the machine: verifying
8 nodes cost 1.55x a plain step on this project's 2-core Zen 4 in bf16 with both threads, 0.93x with one thread
beside a busy core, and 4.6x on an AVX2 machine that emulates bf16 (docs/findings.md). So instead of a fixed K,
at the start of an evaluation:

1. **Verification cost** `t_v(n)`: seconds the target takes to score a tree of n nodes after the root (n = 0 is
   a plain decode step), timed with the decoder's own verifier, as `benchmarks/verify_cost.py` does.
2. **Pilot** on dev prompts (never the reported test prompts): the method's own proposer at its full depth D,
   which gives the accepted length A of every round and the draft's seconds and nodes per round; and at depth 1,
   for the draft's cost per extra level (drafting is one step per level for the sequential drafters).
3. **Prediction** for each depth d in 0..D (0 = plain AR): capping the draft at depth d keeps the first d levels,
   so a round then accepts min(A, d) and emits one more:
       tau(d) = 1 + sum_{k<=d} P(A >= k)       (= 1 + sum_k prod_{i<=k} alpha_i for a chain)
       speed-up(d) = tau(d) * t_v(0) / (t_draft(d) + t_v(n(d)))
   with t_draft and the node count n linear in d between the two pilots. The depth with the highest prediction
   is evaluated; its predicted speed-up is kept beside the measured one.

The choice is one per evaluation, over the evaluation's temperatures pooled, as a deployment makes it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.tree import DraftTree
from specdistill.decoding.verifier import TargetVerifier


class DepthCapped:
    """A proposer drafting at most `depth` levels of the wrapped one (0: no draft, a plain AR round)."""

    def __init__(self, proposer: Any, depth: int):
        self.proposer, self.depth = proposer, depth
        self.feature_layers = getattr(proposer, "feature_layers", ())

    def reset(self) -> None:
        self.proposer.reset()

    def propose(self, context: list[int], max_depth: int, sampling: SamplingConfig, generator: Any,
                features: Any = None) -> DraftTree | None:
        if self.depth == 0:
            return None
        return self.proposer.propose(context, min(max_depth, self.depth), sampling, generator, features)


def chain_tree(n: int, vocab: int, seed: int = 0) -> DraftTree | None:
    """n nodes in a chain (each the child of the one before): what verifying a depth-n chain costs."""
    if n == 0:
        return None
    g = torch.Generator().manual_seed(seed + n)
    return DraftTree(torch.randint(0, vocab, (n,), generator=g), torch.arange(-1, n - 1))


def binary_tree(n: int, vocab: int, seed: int = 0) -> DraftTree | None:
    """n nodes, node i the child of (i - 1) // 2: a bushy tree, verified under a tree mask."""
    if n == 0:
        return None
    g = torch.Generator().manual_seed(seed + n)
    return DraftTree(torch.randint(0, vocab, (n,), generator=g), torch.tensor([(i - 1) // 2 for i in range(n)]))


@torch.inference_mode()
def verify_seconds(verifier: TargetVerifier, context: list[int], nodes: list[int], vocab: int,
                   repeats: int = 8, shape: Any = chain_tree) -> dict[int, float]:
    """Median seconds of one `score` of an n-node tree (`shape(n, vocab)`) over a KV cache of the context, per n
    (benchmarks/verify_cost.py prints the same for a bushy tree)."""
    out = {}
    for n in nodes:
        tree = shape(n, vocab)
        verifier.prefill(context)
        times = []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            verifier.score(context[i % len(context)], tree)
            verifier.commit([])  # keep the root only: the context grows by one token per repeat
            if i >= 2:  # warm-up
                times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times)
    return out


@dataclass
class Pilot:
    """What rounds at one depth cap measured: accepted lengths, draft seconds and draft nodes per round."""

    accepted: list[int] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)

    def add(self, rounds: list[Any]) -> None:
        for r in rounds:  # a round that drafted nothing (prompt lookup without a match) counts: it is one token
            self.accepted.append(r.accepted)
            self.draft_s.append(r.draft_s)
            self.nodes.append(r.draft_len)


def pilot(verifier: TargetVerifier, proposer: Any, prompts: list[list[int]], depth: int, temperatures: list[float],
          max_new_tokens: int, stops: set[int], seed: int) -> Pilot:
    """The proposer capped at `depth` over the pilot prompts at every temperature."""
    capped = DepthCapped(proposer, depth)
    out = Pilot()
    for temp in temperatures:
        sampling = SamplingConfig(temperature=temp)
        for i, prompt in enumerate(prompts):
            g = torch.Generator().manual_seed(seed + i)
            out.add(speculative_generate(verifier, capped, prompt, max_new_tokens, stops, sampling, g).rounds)
    return out


def interpolate(at_1: float, at_d: float, d_max: int, d: int) -> float:
    return at_1 if d_max == 1 else at_1 + (at_d - at_1) * (d - 1) / (d_max - 1)


def predict(deep: Pilot, shallow: Pilot, depth: int, verify_s: dict[int, float]) -> dict[int, dict[str, float]]:
    """{d: tau, nodes, seconds per round, speed-up over AR} for d = 0..depth (see the module docstring)."""
    if not deep.accepted or not shallow.accepted:
        raise ValueError("the pilot ran no round: raise its max_new_tokens")
    ns = sorted(verify_s)

    def t_v(n: float) -> float:  # piecewise linear over the measured node counts
        lo = max((m for m in ns if m <= n), default=ns[0])
        hi = min((m for m in ns if m >= n), default=ns[-1])
        return verify_s[lo] if hi == lo else verify_s[lo] + (verify_s[hi] - verify_s[lo]) * (n - lo) / (hi - lo)

    rounds = len(deep.accepted)
    d1, dd = statistics.fmean(shallow.draft_s), statistics.fmean(deep.draft_s)
    n1, nd = statistics.fmean(shallow.nodes), statistics.fmean(deep.nodes)
    out = {0: {"tau": 1.0, "nodes": 0.0, "round_s": verify_s[0], "speedup": 1.0}}
    for d in range(1, depth + 1):
        tau = 1 + sum(sum(a >= k for a in deep.accepted) / rounds for k in range(1, d + 1))
        nodes = interpolate(n1, nd, depth, d)
        round_s = interpolate(d1, dd, depth, d) + t_v(nodes)
        out[d] = {"tau": tau, "nodes": nodes, "round_s": round_s, "speedup": tau * verify_s[0] / round_s}
    return out


def choose_depth(model: Any, proposer: Any, depth: int, prompts: list[list[int]], temperatures: list[float],
                 max_new_tokens: int, stops: set[int], capacity: int, seed: int) -> dict[str, Any]:
    """Measure, predict, pick: the depth with the highest predicted speed-up, with everything it came from."""
    t0 = time.perf_counter()
    vocab = model.get_output_embeddings().weight.shape[0]
    # one KV cache for the pilots and the timing (each prefills its own context)
    verifier = TargetVerifier(model, capacity, getattr(proposer, "feature_layers", ()))
    deep = pilot(verifier, proposer, prompts, depth, temperatures, max_new_tokens, stops, seed)
    shallow = deep if depth == 1 else pilot(verifier, proposer, prompts, 1, temperatures, max_new_tokens, stops, seed)
    most = max(deep.nodes, default=depth)
    nodes = sorted({0, 1, *[n for n in (2, 4, 8, 16, 32) if n < most], most})
    verify_s = verify_seconds(verifier, prompts[0], nodes, vocab)
    pred = predict(deep, shallow, depth, verify_s)
    best = max(pred, key=lambda d: pred[d]["speedup"])
    return {"depth": best, "predicted": {str(d): {k: round(v, 5) for k, v in p.items()} for d, p in pred.items()},
            "verify_s": {str(n): round(s, 6) for n, s in verify_s.items()}, "pilot_rounds": len(deep.accepted),
            "pilot_prompts": len(prompts), "max_depth": depth, "seconds": round(time.perf_counter() - t0, 2)}
