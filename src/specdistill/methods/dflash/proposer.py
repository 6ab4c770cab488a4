"""The DFlash proposer: a whole block drafted in one forward of the drafter (methods/dflash/model.py).

The drafter keeps each layer's injected keys and values for the committed positions (`features` arrive from the
verifier for every committed token, `loop.Proposer`): positions 0..n-2 when the context holds n tokens, the last
token (n-1) being the one whose target state is not known yet. A round runs the block [x_{n-1}, M, ..., M] at
positions n-1..n-1+K over those keys and its own (no causal mask) and reads slot j's distribution for x_{n-1+j}.

- chain: K tokens, argmax at temperature 0, else each sampled from its slot's warped distribution (q kept: the
  slots do not see each other's draws, so q_j depends on the context only, which the standard rule allows);
- tree (`branching`): the top-b tokens of each slot, each node's children the top of the next slot (the same for
  every parent, as the block cannot tell them apart); nodes are deterministic (q = None), lossless at any T.
With a Markov head (DSpark) each slot's logits also get the bias from the token before it: in a chain the token
just drawn (so q_j depends on the draws before it, as any chain draft's does), in a tree each node's own parent,
so siblings' children differ. With XPress's causal refiner the bias of slot j reads every token before it in the
block (the node's whole path in a tree), resolved slot by slot: exactly the fixed point of XPress's parallel
passes. Nothing drafted is kept: the next round's block starts from the committed context again.
"""

from __future__ import annotations

import torch

from specdistill.core.models.vocab import to_target_logits
from specdistill.decoding.protocols import SamplingConfig, draft_token
from specdistill.decoding.tree import DraftTree
from specdistill.methods.dflash.model import MASK, DFlashDrafter


class DFlashProposer:
    def __init__(self, drafter: DFlashDrafter, k: int | None = None, branching: list[int] | None = None):
        cfg = drafter.cfg
        most = cfg.block_size - 1
        if k is not None and not 1 <= k <= most:
            raise ValueError(f"a DFlash drafter with blocks of {cfg.block_size} drafts 1..{most} tokens, not k={k}")
        if branching is not None and (not branching or min(branching) < 1 or len(branching) > most):
            raise ValueError(f"branching={branching}: one positive factor per drafted position, at most {most}")
        self.drafter = drafter.eval()
        self.k = len(branching) if branching else (k or most)
        self.branching = branching
        self.feature_layers = tuple(cfg.feature_layers)
        self.device, self.dtype = drafter.lm_head.weight.device, drafter.lm_head.weight.dtype
        self.vocab_size = cfg.vocab_size
        self.d2t = None if drafter.d2t is None else drafter.d2t.to(self.device)
        self.reset()

    def reset(self) -> None:
        self.context: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (k, v) [1, nkv, n, d]
        self.committed = 0

    def _catch_up(self, features: torch.Tensor | None) -> None:
        """Injected keys and values for the committed positions whose target states just arrived."""
        if features is None or not len(features):
            return
        n = len(features)
        positions = torch.arange(self.committed, self.committed + n, device=self.device)[None]
        new = self.drafter.context(features.to(self.device)[None], positions)
        if self.context is None:
            self.context = new
        else:
            self.context = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1)
                            in zip(self.context, new, strict=True)]
        self.committed += n

    @torch.inference_mode()
    def block_states(self, last_token: int, k: int) -> torch.Tensor:
        """[k + 1, H] normed states of the block's slots 0..k after the committed context."""
        p = self.committed  # the position of the last token: the context holds the states before it
        ids = torch.tensor([[last_token] + [MASK] * k], device=self.device)
        positions = torch.arange(p, p + k + 1, device=self.device)[None]
        return self.drafter(ids, positions, self.context)[0]

    @torch.inference_mode()
    def block_logits(self, last_token: int, k: int) -> torch.Tensor:
        """[k, N] logits of slots 1..k (the drafter's own vocabulary) for the block after the committed context,
        without a Markov head's bias (`bias` adds it, given the token before a slot)."""
        return self.drafter.logits(self.block_states(last_token, k)[1:]).float()

    @torch.inference_mode()
    def refined(self, states: torch.Tensor, paths: list[list[int]], slot: int) -> torch.Tensor:
        """XPress: [len(paths), N] logits of `slot` for blocks whose slots 0..slot are preceded by each path's target
        ids (the refiner is causal: the ids of later slots, padded here, change nothing)."""
        width = states.shape[0]
        prev = torch.tensor([p + [0] * (width - len(p)) for p in paths], device=self.device)
        logits = self.drafter.block_logits(states[None].expand(len(paths), -1, -1), prev)
        return logits[:, slot].float()

    def bias(self, prev: list[int]) -> torch.Tensor:
        """The Markov head's bias [len(prev), N] for slots preceded by the target ids `prev` (zeros without a head)."""
        if not self.drafter.cfg.markov_rank:
            return torch.zeros(len(prev), self.drafter.lm_head.out_features, device=self.device)
        return self.drafter.markov_bias(torch.tensor(prev, device=self.device)).float()

    @torch.inference_mode()
    def propose(self, context: list[int], max_depth: int, sampling: SamplingConfig,
                generator: torch.Generator | None, features: torch.Tensor | None = None) -> DraftTree | None:
        self._catch_up(features)
        if self.context is None or self.committed != len(context) - 1:
            return None  # no target state before the last token yet (cannot happen inside the loop's contract)
        k = min(self.k, max_depth)
        if k < 1:
            return None
        if self.drafter.cfg.refiner_rank:
            return self._refined_draft(context, k, sampling, generator)
        logits = self.block_logits(context[-1], k)
        if self.branching:
            return self._tree(logits, self.branching[:k], context[-1])
        tokens, qs = [], []
        for j in range(k):
            row = logits[j] + self.bias([tokens[-1] if tokens else context[-1]])[0]  # the token before slot j+1
            tok, q = draft_token(to_target_logits(row, self.d2t, self.vocab_size), sampling, generator)
            tokens.append(tok)
            if q is not None:
                qs.append(q)
        return DraftTree.chain(tokens, torch.stack(qs) if qs else None)

    def _refined_draft(self, context: list[int], k: int, sampling: SamplingConfig,
                       generator: torch.Generator | None) -> DraftTree:
        """XPress: the block once, then each slot's logits with the refiner's bias given the tokens before it."""
        states = self.block_states(context[-1], k)
        start = [context[-2] if len(context) > 1 else context[-1], context[-1]]  # before slots 0 and 1
        if self.branching:
            return self._refined_tree(states, start, self.branching[:k])
        tokens, qs = [], []
        for j in range(1, k + 1):
            row = self.refined(states, [start + tokens], j)[0]
            tok, q = draft_token(to_target_logits(row, self.d2t, self.vocab_size), sampling, generator)
            tokens.append(tok)
            if q is not None:
                qs.append(q)
        return DraftTree.chain(tokens, torch.stack(qs) if qs else None)

    def _refined_tree(self, states: torch.Tensor, start: list[int], widths: list[int]) -> DraftTree:
        """Level d holds each node's top widths[d] tokens of slot d+1 given the node's own path."""
        tokens: list[int] = []
        parents: list[int] = []
        level, paths = [-1], [start]
        for d, width in enumerate(widths):
            top = self.refined(states, paths, d + 1).topk(min(width, self.drafter.lm_head.out_features)).indices
            ids = (top if self.d2t is None else self.d2t[top]).tolist()
            new, new_paths = [], []
            for parent, path, children in zip(level, paths, ids, strict=True):
                for tok in children:
                    new.append(len(tokens))
                    new_paths.append(path + [tok])
                    tokens.append(tok)
                    parents.append(parent)
            level, paths = new, new_paths
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def _tree(self, logits: torch.Tensor, widths: list[int], last_token: int) -> DraftTree:
        """Level d holds the top widths[d] tokens of slot d under every node of level d-1 (topological order); with a
        Markov head, each node's own top tokens given its token."""
        tokens: list[int] = []
        parents: list[int] = []
        level = [-1]
        for d, width in enumerate(widths):
            # one row per node of the level: the slot's logits, plus the head's bias from that node's token
            rows = logits[d] + self.bias([tokens[p] if p >= 0 else last_token for p in level])
            top = rows.topk(min(width, logits.shape[-1])).indices
            ids = (top if self.d2t is None else self.d2t[top]).tolist()
            new = []
            for parent, children in zip(level, ids, strict=True):
                for tok in children:
                    new.append(len(tokens))
                    tokens.append(tok)
                    parents.append(parent)
            level = new
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
