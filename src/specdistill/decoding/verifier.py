"""The target side of speculative decoding: one forward scores the root and every draft node.

The KV cache keeps exactly the accepted path: a chain is cropped, a tree's accepted nodes are
gathered down to sit right after the root (positions stay those of the path, which is what a plain
decode of the same tokens would have written).

Heads that draft from the target's features (Medusa, EAGLE) name the hidden layers they read; the
verifier then keeps those states for every token it commits (`features`, see `loop.Proposer`).
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.core.models.hidden import HiddenTap, Layer
from specdistill.core.models.kv_cache import PreallocatedCache
from specdistill.decoding.tree import DraftTree, tree_attention


class TargetVerifier:
    def __init__(self, model: Any, capacity: int = 4096, feature_layers: tuple[Layer, ...] | list[Layer] = ()):
        self.model = model
        self.tap = HiddenTap(model, feature_layers) if feature_layers else None
        # features [n, H * len(feature_layers)] of the tokens committed by the last prefill/commit
        self.features: torch.Tensor | None = None
        self._scored: torch.Tensor | None = None
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

    def _hidden(self, **kw: Any) -> torch.Tensor:
        """Last hidden states [T, H]; with a tap, the tapped features of these T tokens go to `_scored`."""
        if self.tap is None:
            return self.model.get_decoder()(cache=self.cache, use_cache=True, **kw).last_hidden_state[0]
        with self.tap:
            hidden = self.model.get_decoder()(cache=self.cache, use_cache=True, **kw).last_hidden_state[0]
        self._scored = self.tap.concat()[0]
        return hidden

    def _logits(self, **kw: Any) -> torch.Tensor:
        return self.model.get_output_embeddings()(self._hidden(**kw)).float()

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Feed the prompt; returns the logits [V] for the first new token."""
        self.reset()
        hidden = self._hidden(input_ids=torch.tensor([ids], device=self.device))
        self.features = self._scored
        return self.model.get_output_embeddings()(hidden[-1:]).float()[0]

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
        if self.tap is not None:  # the root and the accepted nodes, in order
            self.features = self._scored[[0] + [i + 1 for i in path]]
        if self._chain:
            self.cache.crop(start + len(path))
        else:
            self.cache.gather_positions(torch.tensor(path, dtype=torch.long, device=self.device) + start, start)
