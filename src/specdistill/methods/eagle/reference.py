"""EAGLE-3 in speculators' trainer (`--speculator-type eagle3`), for the reference stage: our head's settings in its
flags. `matched` builds our head: fc straight from the concatenated layers (`--no-norm-before-fc`), the next
training-time-test step reading the un-normed output (`--no-norm-output`), the layer's input norm after the residual
as in the target's own layers (`--no-norm-before-residual`), full attention (`--full-attention-indices 0`), our
step decay and loss; EAGLE-3.1's per-layer norms (`fc_norm`, `norm_output`) when ours has them. `shipped` keeps
speculators' defaults (its norms, its sliding window, its loss, no step decay) on the same layers and steps."""

from __future__ import annotations

from typing import Any

from specdistill.core.errors import ConfigError
from specdistill.methods import ReferenceArgs, ReferenceContext


def reference(mcfg: Any, ctx: ReferenceContext) -> ReferenceArgs:
    where = f"methods.{mcfg.name}"
    if mcfg.variant != "eagle3":
        raise ConfigError(f"{where}.variant={mcfg.variant}: speculators trains EAGLE-3 heads; its reference is for "
                          "variant eagle3 (EAGLE-3 and EAGLE-3.1)")
    aux = mcfg.layers(ctx.num_layers)
    args = ["--speculator-type", "eagle3", "--target-layer-ids", *map(str, aux), "--ttt-steps", str(mcfg.ttt_steps)]
    if ctx.recipe == "matched":
        if mcfg.step_weights != "decay" or mcfg.noise or mcfg.feature_weight:
            raise ConfigError(f"{where}: step_weights={mcfg.step_weights}, noise={mcfg.noise}, feature_weight="
                              f"{mcfg.feature_weight} have no speculators flag; a matched reference needs decay, 0, 0")
        args += ["--ttt-step-loss-decay", repr(mcfg.step_decay), "--loss-fn", ctx.loss,
                 "--no-norm-before-fc", "--no-norm-before-residual", "--full-attention-indices", "0",
                 "--norm-output" if mcfg.norm_output else "--no-norm-output", *(["--fc-norm"] if mcfg.fc_norm else [])]
    return ReferenceArgs(aux, args)
