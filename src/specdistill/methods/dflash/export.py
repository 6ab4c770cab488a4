"""DFlash in the speculators format: the folder vLLM's DFlash proposer loads (`method: dflash`); with XPress's refiner,
speculators' xpress format (`XPressSpeculatorConfig`: the DFlash fields, the refiner's rank and MLP ratio, its tensors
as `refiner_head.*`), which speculators 0.9 loads and vLLM 0.32 does not serve.

What vLLM 0.32 (`transformers_utils/configs/speculators/algos.py::update_dflash`, `models/qwen3_dflash.py`) and
speculators 0.9 (`DFlashSpeculatorConfig`) read, checked in the tests by loading the config with speculators' own
classes and by serving the export in the engine:

- `speculators_model_type: dflash`, a Qwen3 `transformer_layer_config` (our layer is Qwen3's: RMSNorm per head on
  q and k) with `num_hidden_layers` the drafter's, `block_size`, `draft_vocab_size`, `target_hidden_size`;
- `aux_hidden_state_layer_ids` ascending (vLLM concatenates the aux states in that order: `fc`'s input blocks are
  permuted to match); id k is the residual entering layer k, our `HiddenTap` index;
- `mask_token_id`, and the learned mask embedding as `mask_embedding.pt` ({mask_token_id, embedding}), which vLLM
  puts in place of that token's embedding in the block;
- `sliding_window_non_causal: true`: vLLM turns it into `dflash_config.causal = false` for every layer (its name
  notwithstanding), the block attention the drafter was trained with; false would make the block causal;
- tensors under vLLM's names (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, `hidden_norm.weight`, ...), `d2t`
  as offsets over the draft vocabulary sorted by target id; no embeddings (the engine shares the target's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdistill.core.io import atomic_path
from specdistill.export.speculators import check_against_target, rope_parameters, speculators_header
from specdistill.export.target import ExportError
from specdistill.methods.dflash.model import MASK_FILE


def dflash_state(drafter: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The drafter's tensors under vLLM's names, with fc's blocks and the draft vocabulary in engine order."""
    cfg = drafter.cfg
    state = {k.replace("refiner.", "refiner_head.", 1): v.detach().float().contiguous().cpu()  # speculators' name
             for k, v in drafter.state_dict().items()
             if not k.startswith("rotary.") and k not in ("d2t", "mask_embedding")}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "layers.0.self_attn.q_norm.weight"}
    if missing := sorted(expected - set(state)):
        raise ExportError(f"the DFlash drafter lacks {missing}: not a drafter this export knows")
    order = sorted(range(len(cfg.feature_layers)), key=lambda i: cfg.feature_layers[i])
    h = cfg.hidden_size
    state["fc.weight"] = torch.cat([state["fc.weight"][:, i * h:(i + 1) * h] for i in order], dim=1).contiguous()
    if drafter.d2t is not None:
        d2t = drafter.d2t.cpu().long()
        if len(set(d2t.tolist())) != len(d2t) or int(d2t.max()) >= cfg.vocab_size or int(d2t.min()) < 0:
            raise ExportError("the drafter's d2t map is not a set of distinct target ids: the drafter is corrupt")
        perm = torch.argsort(d2t)
        state["lm_head.weight"] = state["lm_head.weight"][perm].contiguous()
        if "refiner_head.readout.weight" in state:  # the refiner's bias is over the same draft vocabulary
            state["refiner_head.readout.weight"] = state["refiner_head.readout.weight"][perm].contiguous()
        state["d2t"] = (d2t[perm] - torch.arange(len(d2t))).to(torch.int64)
    return state, sorted(cfg.feature_layers)


def export_dflash(drafter: Any, out_dir: str | Path, target_dir: str | Path, num_speculative_tokens: int | None = None
                  ) -> Path:
    """Write `drafter` (a `DFlashDrafter`) as a speculators-format folder that names `target_dir` its verifier."""
    from safetensors.torch import save_file

    cfg, target_dir = drafter.cfg, Path(target_dir)
    if cfg.markov_rank:
        raise ExportError(f"this drafter has a Markov head (DSpark, markov_rank={cfg.markov_rank}), which vLLM's "
                          "DFlash proposer (0.32) does not run, and the format has no field for: served without it, "
                          "it would be another drafter. Export a drafter trained with markov_rank=0 (train@dflash)")
    xpress = {"xpress_rank": cfg.refiner_rank, "xpress_mlp_ratio": cfg.refiner_mlp_ratio,
              "num_jacobi_passes": cfg.block_size - 1} if cfg.refiner_rank else {}  # passes enough to be exact
    k = num_speculative_tokens or cfg.block_size - 1
    if not 1 <= k <= cfg.block_size - 1:
        raise ExportError(f"num_speculative_tokens={k}: a block of {cfg.block_size} drafts 1..{cfg.block_size - 1}")
    t = check_against_target(cfg, target_dir)
    state, layers = dflash_state(drafter)
    rope = rope_parameters(cfg, t)
    config = {
        **(speculators_header("xpress", "XPressSpeculator", k, target_dir, t) if xpress else
           speculators_header("dflash", "DFlashSpeculator", k, target_dir, t)),
        "transformer_layer_config": {
            "model_type": "qwen3", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
            "tie_word_embeddings": False, "rope_parameters": rope, "rope_theta": rope.get("rope_theta"),
            "use_sliding_window": False,
        },
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": layers,
        "mask_token_id": int(cfg.mask_token_id),
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "torch_dtype": "float32",
        **xpress,
    }
    with atomic_path(out_dir, is_dir=True) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save({"mask_token_id": int(cfg.mask_token_id),
                    "embedding": drafter.mask_embedding.detach().float().cpu().clone()}, tmp / MASK_FILE)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(out_dir)
