"""DFlash in speculators' trainer (`--speculator-type dflash`), for the reference stage. `matched`: our block size,
layers, fused layers, mask token, anchors per step (ours per sequence times the sequences of a step), position
weights (decay with our gamma, or D-PACE), full attention and our loss. `shipped`: speculators' defaults (its loss,
its anchors, its sliding window) with our block size, layers, fused layers and mask token, which the export and the
engine need to agree on. speculators starts the drafter's layers afresh; ours start from the target's (`init_layers`),
a difference the matched recipe keeps (its flags have none)."""

from __future__ import annotations

from typing import Any

from specdistill.core.errors import ConfigError
from specdistill.methods import ReferenceArgs, ReferenceContext


def reference(mcfg: Any, ctx: ReferenceContext, mask_token_id: int) -> ReferenceArgs:
    where = f"methods.{mcfg.name}"
    if mcfg.markov_rank or mcfg.refiner_rank:
        raise ConfigError(f"{where}: the reference trains plain DFlash; DSpark's and XPress's heads (markov_rank, "
                          "refiner_rank) have their own speculator types, not matched here: set them to 0")
    aux = mcfg.layers(ctx.num_layers)
    args = ["--speculator-type", "dflash", "--target-layer-ids", *map(str, aux), "--num-layers", str(mcfg.num_layers),
            "--block-size", str(mcfg.block_size), "--mask-token-id", str(mask_token_id),
            # the block attends both ways, as ours (and a full-attention layer anyway): the flag says so in its config,
            # which our reader checks
            "--sliding-window-non-causal"]
    if ctx.recipe == "matched":
        weights = (["--per-position-loss-weight", "dpace", "--dpace-alpha", repr(mcfg.dpace_alpha)]
                   if mcfg.step_weights == "dpace" else
                   ["--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", repr(mcfg.gamma)])
        args += ["--loss-fn", ctx.loss, "--max-anchors", str(mcfg.anchors * ctx.sequences),
                 "--full-attention-indices", *map(str, range(mcfg.num_layers)), *weights]
    return ReferenceArgs(aux, args)
