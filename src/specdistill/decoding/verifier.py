"""The target side of speculative decoding: one forward scores the root and every draft node.

The KV cache keeps exactly the accepted path: a chain is cropped, a tree's accepted nodes are
gathered down to sit right after the root (positions stay those of the path, which is what a plain
decode of the same tokens would have written).
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.decoding.tree import DraftTree, tree_attention
from specdistill.models.kv_cache import PreallocatedCache


class TargetVerifier:
    def __init__(self, model: Any, capacity: int = 4096):
        self.model = model
        self.capacity = capacity
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache: PreallocatedCache | None = None
        self._root_pos = 0
        self._chain = True

    def reset(self) -> None:
        self.cache = PreallocatedCache(self.model.config.num_hidden_layers, self.capacity)

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    def _logits(self, **kw: Any) -> torch.Tensor:
        hidden = self.model.get_decoder()(cache=self.cache, use_cache=True, **kw).last_hidden_state
        return self.model.get_output_embeddings()(hidden[0]).float()

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Feed the prompt; returns the logits [V] for the first new token."""
        self.reset()
        x = torch.tensor([ids], device=self.device)
        hidden = self.model.get_decoder()(input_ids=x, cache=self.cache, use_cache=True).last_hidden_state
        return self.model.get_output_embeddings()(hidden[0, -1:]).float()[0]

    @torch.inference_mode()
    def score(self, root: int, tree: DraftTree | None) -> torch.Tensor:
        """Logits [n+1, V] after the root and after each node; the cache now holds root + nodes."""
        past = self.length
        self._root_pos = past
        if tree is None or len(tree) == 0:
            self._chain = True
            return self._logits(input_ids=torch.tensor([[root]], device=self.device))
        ids = torch.cat([torch.tensor([root]), tree.tokens])[None].to(self.device)
        self._chain = tree.is_chain
        if self._chain:  # plain causal attention does it
            return self._logits(input_ids=ids)
        mask, pos = tree_attention(tree, past, self.dtype, self.device)
        return self._logits(input_ids=ids, attention_mask=mask, position_ids=pos)

    @torch.inference_mode()
    def commit(self, path: list[int]) -> None:
        """Keep the root and the accepted nodes `path` in the cache; drop the other nodes."""
        start = self._root_pos + 1
        if self._chain:
            self.cache.crop(start + len(path))
        else:
            self.cache.gather_positions(torch.tensor(path, dtype=torch.long, device=self.device) + start, start)
