"""vLLM's hidden-states connector, able to run on a CPU: the target's hidden states captured by the engine.

vLLM 0.32 captures a target's hidden states with the `extract_hidden_states` speculative method (its
"draft" caches the states of the layers in `eagle_aux_hidden_state_layer_ids` in a KV-cache group of its
own) and a KV connector that writes each finished request's states to `<shared_storage_path>/<req>.safetensors`
(`hidden_states` [T, n_layers, H], layers in ascending id order; `token_ids` [T]). The stock
`ExampleHiddenStatesConnector` assumes a CUDA device in `_submit_async_write`:

- `torch.cuda.Stream()` (`_get_copy_stream`), `torch.cuda.Event()` and `ready_event.record()`: no CUDA;
- `torch.empty_like(..., device="cpu", pin_memory=True)`: pinning needs a CUDA runtime;
- then `event.synchronize()` in the writer thread and `event.query()` in `get_finished` on those events.

On a CPU the cache already lives in host memory, so the copy is one synchronous gather. This subclass does
that gather when the cache is not on a CUDA device and records a completed marker in place of the copy
event (so the stock `get_finished` and writer thread run unchanged); on a GPU it is the stock connector.
Select it with `kv_connector="CPUHiddenStatesConnector"`, `kv_connector_module_path=
"specdistill_vllm_fixes.hidden_states"`. `load_hidden_states` / `cleanup_hidden_states` are vLLM's
helpers (wait on the file's lock, read; remove the file and its lock), re-exported here.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    cleanup_hidden_states,
    extract_from_kv_cache,
    load_hidden_states,
)

__all__ = ["CPUHiddenStatesConnector", "cleanup_hidden_states", "load_hidden_states"]


class _Copied:
    """Stands for the stock connector's copy event once the copy is done: nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose copy out of the cache is synchronous when the cache is in host memory."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is not None and self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return None
        assert self._kv_cache is not None
        bs = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(bs, dtype=torch.long).reshape(1, bs) + blocks.reshape(-1, 1) * bs).flatten()
        # the gather copies: the blocks may be reused as soon as get_finished reports this request
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        copied = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, copied, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
        return None
