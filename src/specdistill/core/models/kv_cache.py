"""A preallocated KV cache that HF models accept in place of `DynamicCache`.

`DynamicCache` grows by `torch.cat` on every step: a fresh allocation and a full copy of the cache per
layer per token (over a quarter of a decode step's time on the CPU here). This cache writes new keys
and values into a buffer sized once and returns views of its filled part, so attention still runs only
over the tokens seen. Cropping (for speculative decoding) is a length change, and dropping finished
rows of a batch is one gather.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self._k = key_states.new_empty((b, h, self.capacity, d))
        self._v = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({self.length} + {n} tokens): "
                               "size it for prompt length + max_new_tokens")
        self._k[:, :, self.length:self.length + n] = key_states
        self._v[:, :, self.length:self.length + n] = value_states
        self.length += n
        return self.keys, self.values

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:  # DynamicLayer.__init__ assigns None
        if value is not None:
            raise AttributeError("PreallocatedLayer keys are written through update()")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("PreallocatedLayer values are written through update()")

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (negative, as in DynamicLayer), or keep `n >= 0`."""
        self.length = (max(self.length + tokens_to_remove, 0) if tokens_to_remove < 0
                       else min(tokens_to_remove, self.length))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._k is not None:
            self._k = self._k.index_select(0, indices)
            self._v = self._v.index_select(0, indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def gather_positions(self, positions: torch.Tensor, start: int) -> None:
        """Keep cache entries `positions` (absolute indices >= start, ascending) compacted from `start`.

        A tree verification writes all tree nodes; only the accepted path survives (batch size 1).
        """
        if self._k is None:
            return
        n = positions.numel()
        self._k[:, :, start:start + n] = self._k[:, :, positions]
        self._v[:, :, start:start + n] = self._v[:, :, positions]
        self.length = start + n


class PreallocatedCache(DynamicCache):
    """`DynamicCache` whose layers write into buffers of `capacity` tokens."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__()
        self.layers = [PreallocatedLayer(capacity) for _ in range(num_layers)]
        self.layer_class_to_replicate = None

    def crop(self, max_length: int) -> None:
        for layer in self.layers:
            layer.crop(max_length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    def gather_positions(self, positions: torch.Tensor, start: int) -> None:
        for layer in self.layers:
            layer.gather_positions(positions, start)
