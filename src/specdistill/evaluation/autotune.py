"""`eval.depth=auto`: the draft shape (depth and width) for this machine, from its measured costs and a pilot.

A speed-up is tau over what a round costs in plain decode steps, and both halves depend on the machine: verifying
8 nodes cost 1.55x a plain step on this project's 2-core Zen 4 in bf16 with both threads, 0.93x with one thread
beside a busy core, and 4.6x on an AVX2 machine that emulates bf16 (docs/findings.md). So instead of a fixed tree,
at the start of an evaluation:

1. **Verification cost** `t_v(n)`: seconds the target takes to score a tree of n nodes after the root (n = 0 is
   a plain decode step), timed with the decoder's own verifier, as `benchmarks/verify_cost.py` does.
2. **Pilot** on dev prompts (never the reported test prompts): the method's own proposer at its full depth D,
   recording every round's tree and the path the target kept; and at depth 1, for the draft's cost per extra
   level (drafting is one step per level for the sequential drafters).
3. **Prediction** for each shape (d, w): depth d in 0..D (0 = plain AR) and width w, the first w children of each
   node (w = 1: the tree's path of first children, a chain; siblings are verified in their order in the tree,
   `DraftTree.reach`). A pilot round whose kept path has m nodes among the first w children would
   have kept min(m, d) of them in the pruned tree (per pilot round: exactly at T = 0, in distribution at T > 0,
   because the verifier tries the first w siblings of the pruned tree as it tried them in the whole one; tau is
   then estimated from the pilot's rounds). So
       tau(d, w) = 1 + mean over rounds of min(m_w, d)    (= 1 + sum_k prod_{i<=k} alpha_i for a chain)
       speed-up(d, w) = tau(d, w) * t_v(0) / (t_draft(d) + mean over rounds of t_v(nodes(d, w)))
   with t_draft linear in d between the two pilots (a width is pruned after drafting: it saves verification, not
   drafting). Each prediction carries the pilot's standard error (tau's, over its rounds), and the standard error of
   its gap to the highest prediction, paired over the rounds (the shapes are prunings of the same trees); the shape
   evaluated is the cheapest per round among those whose gap is within that error (`choose`: the one-standard-error
   rule, plain AR when the best does not clear AR by its own error), and its prediction is kept beside the measured
   speed-up. The depth cap is exact where drafting d levels gives the first d levels of the deep tree
   (chains, static and top-k trees, lookup, Medusa); EAGLE-2's dynamic tree and suffix decoding re-spend their node
   budget on the kept levels, and DFlash drafts a shorter block whose slots see each other, so there the deployed
   tree at d < D can differ from the prediction's. Verification is timed on chains; a wider shape is verified under a
   tree mask, which cost the same within noise on a 2-core AVX2 EPYC in bf16 (8 nodes: 167 ms as a chain, 159 ms as a
   binary tree; `verify_seconds(..., shape=binary_tree)`).

Labels: "2" is depth 2 at the method's own width, "2w1" depth 2 of the first children only (a chain), "0" AR.
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


class Capped:
    """A proposer drafting at most `depth` levels of the wrapped one (0: no draft, a plain AR round; None: its
    own), and of those only the first `width` children of each node (None: all)."""

    def __init__(self, proposer: Any, depth: int | None, width: int | None = None):
        self.proposer, self.depth, self.width = proposer, depth, width
        self.feature_layers = getattr(proposer, "feature_layers", ())

    def reset(self) -> None:
        self.proposer.reset()

    def propose(self, context: list[int], max_depth: int, sampling: SamplingConfig, generator: Any,
                features: Any = None) -> DraftTree | None:
        if self.depth == 0:
            return None
        depth = max_depth if self.depth is None else min(max_depth, self.depth)
        tree = self.proposer.propose(context, depth, sampling, generator, features)
        return tree if tree is None or self.width is None else tree.prune(width=self.width)


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
class Round:
    """One pilot round as the prediction needs it: the draft's seconds, and per node of the verified tree its
    depth and reach (`DraftTree.reach`), and the reach of each node on the path the target kept."""

    draft_s: float
    depth: list[int]
    reach: list[int]
    kept: list[int]

    @classmethod
    def chain(cls, nodes: int, accepted: int, draft_s: float) -> Round:
        """A chain round of `nodes` drafted tokens of which the first `accepted` were kept."""
        return cls(draft_s, list(range(1, nodes + 1)), [0] * nodes, [0] * accepted)

    def accepted(self, depth: int, width: int | None) -> int:
        """Tokens this round would have kept from its tree pruned to (depth, width)."""
        m = len(self.kept) if width is None else sum(r < width for r in self.kept)  # reach grows along a path
        return min(m, depth)

    def nodes(self, depth: int, width: int | None) -> int:
        return sum(d <= depth and (width is None or r < width) for d, r in zip(self.depth, self.reach, strict=True))


@dataclass
class Pilot:
    """What rounds at one depth cap measured."""

    rounds: list[Round] = field(default_factory=list)

    @property
    def widest(self) -> int:
        """Children of the widest node any round drafted (1: chains only)."""
        return 1 + max((r for rnd in self.rounds for r in rnd.reach), default=0)


class Recording:
    """The verifier, recording each scored tree and the path committed from it (the loop's own calls)."""

    def __init__(self, verifier: TargetVerifier):
        self.verifier, self.trees, self.kept = verifier, [], []

    @property
    def features(self) -> Any:
        return self.verifier.features

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.verifier.prefill(ids)

    def score(self, root: int, tree: DraftTree | None) -> torch.Tensor:
        self.trees.append(tree if tree is not None else DraftTree.empty())
        return self.verifier.score(root, tree)

    def commit(self, path: list[int]) -> None:
        self.kept.append(list(path))
        self.verifier.commit(path)


def pilot(verifier: TargetVerifier, proposer: Any, prompts: list[list[int]], depth: int, temperatures: list[float],
          max_new_tokens: int, stops: set[int], seed: int) -> Pilot:
    """The proposer capped at `depth` over the pilot prompts at every temperature."""
    capped = Capped(proposer, depth)
    out = Pilot()
    for temp in temperatures:
        sampling = SamplingConfig(temperature=temp)
        for i, prompt in enumerate(prompts):
            g = torch.Generator().manual_seed(seed + i)
            rec = Recording(verifier)
            res = speculative_generate(rec, capped, prompt, max_new_tokens, stops, sampling, g)
            # a round that drafted nothing (prompt lookup without a match) counts: it is one token
            for stats, tree, kept in zip(res.rounds, rec.trees, rec.kept, strict=True):
                reach = tree.reach.tolist()
                out.rounds.append(Round(stats.draft_s, tree.depth.tolist(), reach, [reach[i] for i in kept]))
    return out


def label(depth: int, width: int | None) -> str:
    return str(depth) if width is None or depth == 0 else f"{depth}w{width}"


def interpolate(at_1: float, at_d: float, d_max: int, d: int) -> float:
    return at_1 if d_max == 1 else at_1 + (at_d - at_1) * (d - 1) / (d_max - 1)


def predict(deep: Pilot, shallow: Pilot, depth: int, verify_s: dict[int, float]) -> dict[str, dict[str, Any]]:
    """{label: depth, width, tau, nodes, seconds per round, speed-up over AR} for every shape (module docstring):
    depths 0..depth, widths 1.. below the widest the pilot drafted, and the method's own (width None)."""
    if not deep.rounds or not shallow.rounds:
        raise ValueError("the pilot ran no round: raise its max_new_tokens")
    ns = sorted(verify_s)

    def t_v(n: float) -> float:  # piecewise linear over the measured node counts
        lo = max((m for m in ns if m <= n), default=ns[0])
        hi = min((m for m in ns if m >= n), default=ns[-1])
        return verify_s[lo] if hi == lo else verify_s[lo] + (verify_s[hi] - verify_s[lo]) * (n - lo) / (hi - lo)

    d1 = statistics.fmean(r.draft_s for r in shallow.rounds)
    dd = statistics.fmean(r.draft_s for r in deep.rounds)
    out: dict[str, dict[str, Any]] = {"0": {"depth": 0, "width": None, "tau": 1.0, "nodes": 0.0,
                                            "round_s": verify_s[0], "speedup": 1.0, "speedup_se": 0.0}}
    # each round's share of each shape's speed-up: the speed-up is their mean, and shapes compare round by round
    per_round: dict[str, list[float]] = {"0": [1.0] * len(deep.rounds)}
    widths = [*range(1, deep.widest), None]
    for d in range(1, depth + 1):
        for w in widths:
            kept = [r.accepted(d, w) for r in deep.rounds]
            nodes = [r.nodes(d, w) for r in deep.rounds]
            round_s = interpolate(d1, dd, depth, d) + statistics.fmean(t_v(n) for n in nodes)
            per_round[label(d, w)] = [(1 + a) * verify_s[0] / round_s for a in kept]
            out[label(d, w)] = {"depth": d, "width": w, "tau": 1 + statistics.fmean(kept),
                                "nodes": statistics.fmean(nodes), "round_s": round_s,
                                "speedup": statistics.fmean(per_round[label(d, w)]),
                                "speedup_se": _se(per_round[label(d, w)])}  # the pilot's sampling error of tau
    best = max(out, key=lambda k: out[k]["speedup"])  # ties: the first, i.e. the shallower and narrower
    for k, p in out.items():
        # the standard error of the gap to the best, paired over the pilot's rounds: the shapes are prunings of one
        # tree, so they err together and their gaps are known better than either alone (against AR: the best's own)
        p["se_vs_best"] = _se([b - x for b, x in zip(per_round[best], per_round[k], strict=True)])
        p["best"] = k == best  # the shape the gaps were taken to: `choose` reads it, not a max over rounded figures
    return out


def _se(xs: list[float]) -> float:
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0


def choose(pred: dict[str, dict[str, Any]]) -> str:
    """The one-standard-error rule: of the shapes whose predicted speed-up is within one standard error of the best
    prediction's, the cheapest per round (plain AR first). The error is that of each shape's gap to the best, paired
    over the pilot's rounds (`se_vs_best`): the pilot's sampling error of tau, a lower bound on the prediction's (the
    timing model's own error, draft seconds interpolated between two depths and trees timed as chains, is not in
    it). A pilot of a few dozen rounds cannot tell such shapes apart, and the cheaper one spends less where the
    prediction errs (docs/findings.md: on the default EAGLE-3 head the best prediction was depth 2 at 1.31x against
    depth 1 at 1.28x, with a standard error of 0.08, and depth 1 measured fastest)."""
    # the shape `predict` took the gaps to; records before it marked one: the best prediction (ties: the first)
    best = next((k for k, p in pred.items() if p.get("best")), None) or max(pred, key=lambda k: pred[k]["speedup"])
    own = pred[best].get("speedup_se", 0.0)  # records before the paired error: every gap against the best's own

    def within(k: str) -> bool:
        return pred[best]["speedup"] - pred[k]["speedup"] <= pred[k].get("se_vs_best", own)
    return min(filter(within, pred), key=lambda k: pred[k]["round_s"])  # ties: the first


def choose_depth(model: Any, proposer: Any, depth: int, prompts: list[list[int]], temperatures: list[float],
                 max_new_tokens: int, stops: set[int], capacity: int, seed: int) -> dict[str, Any]:
    """Measure, predict, pick (`choose`): the shape to evaluate, with everything it came from."""
    t0 = time.perf_counter()
    vocab = model.get_output_embeddings().weight.shape[0]
    # one KV cache for the pilots and the timing (each prefills its own context)
    verifier = TargetVerifier(model, capacity, getattr(proposer, "feature_layers", ()))
    deep = pilot(verifier, proposer, prompts, depth, temperatures, max_new_tokens, stops, seed)
    shallow = deep if depth == 1 else pilot(verifier, proposer, prompts, 1, temperatures, max_new_tokens, stops, seed)
    most = max((len(r.depth) for r in deep.rounds), default=depth)
    nodes = sorted({0, 1, *[n for n in (2, 4, 8, 16, 32) if n < most], most})
    verify_s = verify_seconds(verifier, prompts[0], nodes, vocab)
    pred = predict(deep, shallow, depth, verify_s)
    best = choose(pred)
    return {"depth": pred[best]["depth"], "width": pred[best]["width"], "choice": best,
            "best_predicted": next(k for k, p in pred.items() if p["best"]), "rule": "one standard error",
            "predicted": {k: {f: v if f in ("width", "best") or v is None else round(v, 5) for f, v in p.items()}
                          for k, p in pred.items()},
            "verify_s": {str(n): round(s, 6) for n, s in verify_s.items()}, "pilot_rounds": len(deep.rounds),
            "pilot_prompts": len(prompts), "pilot_tokens": max_new_tokens, "max_depth": depth,
            "seconds": round(time.perf_counter() - t0, 2)}
