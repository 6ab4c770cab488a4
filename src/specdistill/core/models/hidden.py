"""Hidden states of a HF decoder-only model, taken by forward hooks during an ordinary forward.

Indices follow `output_hidden_states`: 0 is the embedding output and i (1..num_layers) the output of
decoder layer i, so index num_layers is the final norm's INPUT (what EAGLE heads read). "final" is
the normed state (what the LM head and Medusa heads read). Hooks cost nothing when unused and, unlike
`output_hidden_states`, work on any call path (the bare decoder with our KV cache, tree masks).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

Layer = int | str


class HiddenLayerError(ValueError):
    """A requested hidden layer does not exist."""


def _module(model: Any, idx: Layer) -> torch.nn.Module:
    decoder = model.get_decoder()
    n = model.config.num_hidden_layers
    if idx == "final":
        return decoder.norm
    if isinstance(idx, int) and not isinstance(idx, bool):
        if idx == 0:
            return decoder.embed_tokens
        if 1 <= idx <= n:
            return decoder.layers[idx - 1]
    raise HiddenLayerError(f"hidden layer {idx!r} out of range 0..{n} or 'final'")


class HiddenTap:
    """`with HiddenTap(model, [15, 30]) as tap: model(...)`, then `tap.states[15]` is [B, T, H]."""

    def __init__(self, model: Any, layers: list[Layer] | tuple[Layer, ...]):
        self.layers = list(layers)
        self.modules = [_module(model, idx) for idx in self.layers]  # fails at once on a bad index
        self.states: dict[Layer, torch.Tensor] = {}
        self._handles: list[Any] = []

    def _keep(self, idx: Layer, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.states[idx] = output

    def __enter__(self) -> HiddenTap:
        self.states = {}
        self._handles = [m.register_forward_hook(partial(self._keep, idx))
                         for idx, m in zip(self.layers, self.modules, strict=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def concat(self) -> torch.Tensor:
        """The requested states side by side, [B, T, H * len(layers)] (EAGLE-3 fuses three layers)."""
        return torch.cat([self.states[idx] for idx in self.layers], dim=-1)


def fused_layers(num_layers: int) -> list[int]:
    """The low, middle and high layers a fusing head reads by default, [2, L//2, L-3], as HiddenTap indices (0 =
    embeddings, i = output of layer i): what the reference code, vLLM, SGLang and speculators take when none are
    given (EAGLE-3 and DFlash read them)."""
    return [2, num_layers // 2, num_layers - 3]


def store_layers(num_layers: int) -> list[int]:
    """What the features store holds by default: the fused layers and the last layer's output (what a head on the
    top state reads, EAGLE-1), so one store serves every head and its stage needs no method's code."""
    return sorted(set(fused_layers(num_layers)) | {num_layers})
