"""The separate draft's proposer, `DraftLMProposer`: a causal LM that shares the target's tokenizer drafts a chain of
K tokens (sampled from its warped distribution, or its argmax at temperature 0) or a top-k tree with a branching
factor per depth (deterministic nodes), scored level by level with tree attention.
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.core.models.kv_cache import PreallocatedCache
from specdistill.core.models.vocab import to_target_logits
from specdistill.decoding.protocols import SamplingConfig, draft_token
from specdistill.decoding.tree import DraftTree, tree_attention


class DraftLMProposer:
    feature_layers = ()  # a separate LM reads tokens only
    def __init__(self, model: Any, k: int = 4, branching: list[int] | None = None, capacity: int = 4096):
        if branching is not None and (not branching or min(branching) < 1):
            raise ValueError(f"branching={branching}: one positive branching factor per depth")
        self.model = model.eval()
        self.k = len(branching) if branching else k
        self.branching = branching
        self.capacity = capacity
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # a reduced-vocabulary draft (methods/draft/model.py): its head scores d2t's target ids only, and q
        # is zero elsewhere, so greedy picks, top-k children and the sampling rule all stay lossless
        d2t = getattr(model, "d2t", None)
        self.d2t = None if d2t is None else d2t.to(self.device)
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.reset()

    def reset(self) -> None:
        self.cache = PreallocatedCache(self.model.config.num_hidden_layers, self.capacity)
        self.cached: list[int] = []

    def _forward(self, ids: list[int] | torch.Tensor, **kw: Any) -> torch.Tensor:
        x = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
        hidden = self.model.get_decoder()(input_ids=x, cache=self.cache, use_cache=True, **kw).last_hidden_state
        return to_target_logits(self.model.get_output_embeddings()(hidden[0]).float(), self.d2t, self.vocab_size)

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """Feed the context tokens the cache lacks; returns the logits after the last one."""
        common = 0
        for a, b in zip(self.cached, context, strict=False):  # lengths differ by design
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)  # always refeed at least the last token
        self.cache.crop(common)
        logits = self._forward(context[common:])[-1]
        self.cached = list(context)
        return logits

    @torch.inference_mode()
    def propose(self, context: list[int], max_depth: int, sampling: SamplingConfig,
                generator: torch.Generator | None, features: torch.Tensor | None = None) -> DraftTree | None:
        logits = self._catch_up(context)
        base = len(context)
        try:
            if self.branching:
                return self._tree(logits, base, self.branching[:max_depth])
            return self._chain(logits, min(self.k, max_depth), sampling, generator)
        finally:
            self.cache.crop(base)  # drafts are speculative: keep only the context

    def _chain(self, logits: torch.Tensor, k: int, sampling: SamplingConfig,
               generator: torch.Generator | None) -> DraftTree:
        tokens, qs = [], []
        for i in range(k):
            tok, q = draft_token(logits, sampling, generator)
            tokens.append(tok)
            if q is not None:
                qs.append(q)
            if i + 1 < k:
                logits = self._forward([tok])[-1]
        return DraftTree.chain(tokens, torch.stack(qs) if qs else None)

    def _tree(self, root_logits: torch.Tensor, base: int, branching: list[int]) -> DraftTree:
        """Top-b children of every frontier node, depth by depth; one draft forward per depth."""
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [(-1, root_logits)]
        for depth, b in enumerate(branching):
            level: list[int] = []
            for node, logits in frontier:
                for tok in torch.topk(logits, b).indices.tolist():
                    tokens.append(tok)
                    parents.append(node)
                    level.append(len(tokens) - 1)
            if depth + 1 == len(branching):
                break
            tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
            mask, pos = tree_attention(tree, base, self.dtype, self.device, root=False)
            first = level[0]  # the cache holds the context and the nodes before this level
            out = self._forward(tree.tokens[first:], attention_mask=mask[:, :, first:, : base + len(tokens)],
                                position_ids=pos[:, first:])
            frontier = [(n, out[j]) for j, n in enumerate(level)]
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))
