"""A separate draft LM that shares the target's tokenizer.

`draft_from_target` is the untrained starting point the decoder is measured with until distilled
drafts exist: the target's embeddings, final norm and LM head with its first N decoder layers.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class DraftError(ValueError):
    """The draft cannot serve this target."""


def draft_from_target(target: Any, num_layers: int) -> Any:
    """A copy of `target` truncated to its first `num_layers` decoder layers (frozen, eval mode)."""
    total = target.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise DraftError(f"draft num_layers={num_layers} must be in 1..{total} (the target's layer count)")
    draft = copy.deepcopy(target)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:num_layers])
    draft.config.num_hidden_layers = num_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = list(draft.config.layer_types)[:num_layers]
    return draft.eval().requires_grad_(False)


def check_same_vocabulary(draft: Any, target: Any) -> None:
    dv, tv = draft.get_output_embeddings().weight.shape[0], target.get_output_embeddings().weight.shape[0]
    if dv != tv:
        raise DraftError(f"the draft's vocabulary ({dv}) differs from the target's ({tv}): a draft must share the "
                         "target's tokenizer, or come with a map from its vocabulary to the target's")
