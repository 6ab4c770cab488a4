"""The EAGLE proposer: chain, static tree, and EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2:
Faster Inference of Language Models with Dynamic Draft Trees").

The head keeps its own one-layer KV cache. Committed positions j hold the entry made from the
target's state h_j and the token x_{j+1} (`features` arrive from the verifier for every committed
token, `loop.Proposer`); the entry of the last committed position (the anchor, n-1) predicts depth 1.
A drafted node at depth d sits at position n-1+d; expanding it (to get its children) runs the head
on (its parent's predicted state, its token), attending to the committed entries and to its own
ancestors' entries. Drafted entries are dropped after each round.

- chain: K steps, argmax at temperature 0, sampled from the head's warped distribution otherwise
  (q kept, the standard rule);
- static tree: the top-b children of every node, b per depth;
- dynamic (EAGLE-2): at each depth expand only the `top_k` nodes of highest cumulative draft
  log-probability, each proposing its `top_k` children; after `depth` levels keep the
  `total_tokens` best nodes overall (a child never outscores its parent, so they form a tree).
Tree nodes are deterministic (q = None), which the verifier's rule keeps lossless at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.core.models.kv_cache import PreallocatedCache
from specdistill.core.models.vocab import to_target_logits
from specdistill.decoding.protocols import SamplingConfig, draft_token
from specdistill.decoding.tree import DraftTree
from specdistill.methods.eagle.model import EagleHead

SHAPES = ("chain", "static", "dynamic")


@dataclass
class EagleTreeConfig:
    shape: str = "dynamic"  # chain | static | dynamic
    k: int = 4  # chain length
    branching: list[int] | None = None  # static tree: children per node, per depth
    depth: int = 3  # dynamic tree: levels
    top_k: int = 3  # dynamic tree: nodes expanded per level, children per expanded node
    total_tokens: int = 8  # dynamic tree: nodes kept for verification (decode.eagle.tree's: 8 beat 12, 16 on 2 cores)

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"eagle tree shape={self.shape!r}: use one of {SHAPES}")
        if self.shape == "static" and (not self.branching or min(self.branching) < 1):
            raise ValueError(f"a static EAGLE tree needs branching (children per depth), got {self.branching}")
        if min(self.k, self.depth, self.top_k, self.total_tokens) < 1:
            raise ValueError("eagle k, depth, top_k and total_tokens must be >= 1")
        most = self.top_k + (self.depth - 1) * self.top_k ** 2  # level 1, then top_k children of top_k nodes
        if self.shape == "dynamic" and self.total_tokens > most:
            raise ValueError(f"a dynamic EAGLE tree of depth {self.depth} and top_k {self.top_k} grows at most {most} "
                             f"nodes, not total_tokens={self.total_tokens}: lower total_tokens or raise depth / top_k")


class EagleProposer:
    def __init__(self, head: EagleHead, tree: EagleTreeConfig | None = None, capacity: int = 4096):
        self.head = head.eval()
        self.tree = tree or EagleTreeConfig()
        self.feature_layers = tuple(head.cfg.feature_layers)
        self.capacity = capacity
        param = head.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size = head.cfg.vocab_size
        self.d2t = None if head.d2t is None else head.d2t.to(self.device)
        self.reset()

    def reset(self) -> None:
        self.cache = PreallocatedCache(1, self.capacity)
        self.committed = 0  # positions with an entry from the target's state
        self.anchor_out: torch.Tensor | None = None  # [H] predicted state at the anchor
        self.anchor_logits: torch.Tensor | None = None  # [N] over the head's vocabulary

    # --- the head on a set of new entries ---------------------------------------------------------
    def _run(self, hidden: torch.Tensor, tokens: list[int], positions: list[int], visible: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """New entries [n] (hidden [n, H]); `visible` [n, cache + n] bool. Returns (states [n, H], logits [n, N])
        over the head's own vocabulary: trees rank within it and map only the chosen ids through d2t."""
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible.to(self.device), torch.finfo(self.dtype).min)
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.tensor([positions], device=self.device)
        out, logits = self.head.step(hidden[None].to(self.dtype), ids, pos, mask[None, None], self.cache)
        return out[0], logits[0].float()

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits over the target's vocabulary (-inf off a reduced head's d2t)."""
        return to_target_logits(logits.float(), self.d2t, self.vocab_size)

    def _catch_up(self, context: list[int], features: torch.Tensor | None) -> None:
        """Entries for the committed positions whose target states just arrived."""
        if features is None or not len(features):
            return
        start, n = self.committed, len(features)
        if self.cache.get_seq_length() != start:
            self.cache.crop(start)
        hidden = self.head.features_in(features.to(self.device))
        tokens = context[start + 1:start + n + 1]
        visible = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)  # causal over all committed
        out, logits = self._run(hidden, tokens, list(range(start, start + n)), visible)
        self.committed += n
        self.anchor_out, self.anchor_logits = out[-1], logits[-1]

    @torch.inference_mode()
    def propose(self, context: list[int], max_depth: int, sampling: SamplingConfig,
                generator: torch.Generator | None, features: torch.Tensor | None = None) -> DraftTree | None:
        self._catch_up(context, features)
        if self.anchor_logits is None or self.committed != len(context) - 1:
            return None  # no state for the anchor yet (cannot happen inside the loop's contract)
        try:
            cfg = self.tree
            if cfg.shape == "chain":
                return self._chain(min(cfg.k, max_depth), sampling, generator)
            if cfg.shape == "static":
                return self._grow([b for b in cfg.branching[:max_depth]], keep=None)
            return self._grow([cfg.top_k] * min(cfg.depth, max_depth), keep=cfg.top_k, total=cfg.total_tokens)
        finally:
            self.cache.crop(self.committed)

    # --- shapes -----------------------------------------------------------------------------------
    def _chain(self, k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        tokens, qs = [], []
        out, logits = self.anchor_out, self.anchor_logits
        base = self.committed
        for d in range(1, k + 1):
            tok, q = draft_token(self._full(logits), sampling, generator)
            tokens.append(tok)
            if q is not None:
                qs.append(q)
            if d < k:  # expand the new node: it sees the committed entries and the chain so far
                visible = torch.ones(1, base + d, dtype=torch.bool)
                out, lg = self._run(out[None], [tok], [base - 1 + d], visible)
                out, logits = out[0], lg[0]
        return DraftTree.chain(tokens, torch.stack(qs) if qs else None)

    def _grow(self, widths: list[int], keep: int | None, total: int | None = None) -> DraftTree:
        """Level by level: children of the expanded nodes; `keep` None expands every node (static tree),
        else the `keep` best by cumulative log-probability (dynamic); `total` trims the result (dynamic).
        A level is one head call and one batched top-k over the head's own vocabulary (a per-node top-k
        over the target's 49k vocabulary was a quarter of the drafting time on a CPU)."""
        base = self.committed
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depth: list[int] = []
        entry: dict[int, int] = {}  # node -> its column in the cache (expanded nodes)
        frontier = [-1]  # the nodes whose children this level drafts; -1 is the anchor
        states, logits = self.anchor_out[None], self.anchor_logits[None]
        for d, width in enumerate(widths, start=1):
            logp = torch.log_softmax(logits, -1)
            top = torch.topk(logp, min(width, logp.shape[-1]), dim=-1)
            prior = torch.tensor([scores[i] if i >= 0 else 0.0 for i in frontier], device=top.values.device)
            cum = top.values + prior[:, None]  # (on the head's device: a GPU run must not mix in a CPU tensor)
            ids = top.indices if self.d2t is None else self.d2t[top.indices]
            first, per = len(tokens), top.indices.shape[-1]
            tokens += ids.flatten().tolist()
            scores += cum.flatten().tolist()
            parents += [node for node in frontier for _ in range(per)]
            depth += [d] * cum.numel()
            if d == len(widths):
                break
            level = list(range(first, len(tokens)))
            if keep is not None:
                level = sorted(level, key=lambda i: -scores[i])[:keep]
            level = [i for i in level if scores[i] > float("-inf")]
            if not level:
                break
            hidden = states[[(i - first) // per for i in level]]  # each node's parent's predicted state
            states, logits = self._expand(level, hidden, tokens, parents, depth, entry, base)
            frontier = level
        keep_nodes = list(range(len(tokens)))
        if total is not None and len(tokens) > total:
            keep_nodes = sorted(sorted(keep_nodes, key=lambda i: -scores[i])[:total])
            kept = set(keep_nodes)
            for i in list(keep_nodes):  # ties could orphan a node: keep its ancestors too
                p = parents[i]
                while p >= 0 and p not in kept:
                    kept.add(p)
                    p = parents[p]
            keep_nodes = sorted(kept)
        return self._tree(keep_nodes, tokens, parents, depth)

    def _expand(self, level: list[int], hidden: torch.Tensor, tokens: list[int], parents: list[int],
                depth: list[int], entry: dict[int, int], base: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head on `level`'s nodes (one forward): (their predicted states, their logits)."""
        cols = base + len(entry)
        visible = torch.zeros(len(level), cols + len(level), dtype=torch.bool)
        visible[:, :base] = True
        for r, i in enumerate(level):
            visible[r, cols + r] = True
            p = parents[i]
            while p >= 0:
                visible[r, entry[p]] = True
                p = parents[p]
        out = self._run(hidden, [tokens[i] for i in level], [base - 1 + depth[i] for i in level], visible)
        for r, i in enumerate(level):
            entry[i] = cols + r
        return out

    @staticmethod
    def _tree(keep: list[int], tokens: list[int], parents: list[int], depth: list[int]) -> DraftTree:
        order = sorted(keep, key=lambda i: (depth[i], i))  # topological: parents are shallower
        index = {node: j for j, node in enumerate(order)}
        return DraftTree(torch.tensor([tokens[i] for i in order], dtype=torch.long),
                         torch.tensor([index[parents[i]] if parents[i] >= 0 else -1 for i in order], dtype=torch.long))
