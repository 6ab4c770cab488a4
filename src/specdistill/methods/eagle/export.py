"""EAGLE-3 in the speculators format: the folder vLLM loads natively (`vllm serve <folder>` serves target + draft).

Field by field what vLLM 0.32 and speculators 0.9 read (checked against their source and, in the tests, by
loading the config with speculators' own `SpeculatorModelConfig` and serving it in the engine):

- no top-level `model_type` (with one, vLLM reads a plain Llama config and ignores the rest);
- `speculators_config.verifier.name_or_path`: the target folder, which vLLM serves with the draft. Written
  relative to the project when the target lies inside it (run the engine from the project root), so the export
  hashes the same in every checkout;
- `eagle_aux_hidden_state_layer_ids` at the top level, ascending: vLLM sorts the ids and concatenates the aux
  states in that order, so `fc`'s input blocks are permuted to match. Id k is the residual stream after k decoder
  layers (0 = embeddings), the same index as our `HiddenTap`;
- `norm_before_residual: false` stated: vLLM assumes true for a speculators config and would compute another
  residual without an error; ours keeps the un-normed fused state as the residual;
- EAGLE-3.1's `fc_norm` (per fused layer, `fc_norm.{i}` in the same ascending order as fc's blocks) and
  `norm_output`, as the head was trained;
- tensors as speculators names them (`layers.0.*`), `d2t` (the offset: target id = i + d2t[i]) and `t2d` only for a
  reduced vocabulary (vLLM has no slot for them otherwise and refuses the load), the draft vocabulary sorted by
  target id as speculators expects; the embeddings are the target's and not written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdistill.core.io import atomic_path
from specdistill.export.speculators import check_against_target, rope_parameters, speculators_header
from specdistill.export.target import ExportError


def eagle3_state(head: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The head's tensors under speculators' names, with fc's blocks and the draft vocabulary in engine order."""
    cfg = head.cfg
    state = {k.replace("midlayer.", "layers.0.", 1): v.detach().float().contiguous().cpu()
             for k, v in head.state_dict().items() if not k.startswith("rotary.") and k != "d2t"}
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight",
                "layers.0.input_layernorm.weight", "layers.0.self_attn.q_proj.weight"}
    if missing := sorted(expected - set(state)):
        raise ExportError(f"the EAGLE-3 head lacks {missing}: not an eagle3 head this export knows")
    order = sorted(range(len(cfg.feature_layers)), key=lambda i: cfg.feature_layers[i])
    h = cfg.hidden_size
    state["fc.weight"] = torch.cat([state["fc.weight"][:, i * h:(i + 1) * h] for i in order], dim=1).contiguous()
    if cfg.fc_norm:
        norms = [state.pop(f"fc_norm.{i}.weight") for i in range(len(order))]
        state.update({f"fc_norm.{j}.weight": norms[i] for j, i in enumerate(order)})
    if head.d2t is not None:
        d2t = head.d2t.cpu().long()
        if len(set(d2t.tolist())) != len(d2t) or int(d2t.max()) >= cfg.vocab_size or int(d2t.min()) < 0:
            raise ExportError("the head's d2t map is not a set of distinct target ids: the head is corrupt")
        perm = torch.argsort(d2t)  # ascending target ids: the same distribution, in the order speculators reads
        d2t = d2t[perm]
        state["lm_head.weight"] = state["lm_head.weight"][perm].contiguous()
        state["d2t"] = (d2t - torch.arange(len(d2t))).to(torch.int64)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[d2t] = True
        state["t2d"] = t2d
    return state, sorted(cfg.feature_layers)


def export_eagle3(head: Any, out_dir: str | Path, target_dir: str | Path, num_speculative_tokens: int = 3) -> Path:
    """Write `head` (an eagle3 `EagleHead`) as a speculators-format folder that names `target_dir` its verifier."""
    from safetensors.torch import save_file

    cfg, target_dir = head.cfg, Path(target_dir)
    if cfg.variant != "eagle3":
        raise ExportError(f"only eagle3 heads have the speculators EAGLE-3 format (got {cfg.variant})")
    if num_speculative_tokens < 1:
        raise ExportError(f"num_speculative_tokens={num_speculative_tokens}: the engine drafts at least 1 token")
    t = check_against_target(cfg, target_dir)
    state, layers = eagle3_state(head)
    rope = rope_parameters(cfg, t)
    config = {
        **speculators_header("eagle3", "Eagle3Speculator", num_speculative_tokens, target_dir, t),
        "transformer_layer_config": {
            "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "tie_word_embeddings": False, "rope_parameters": rope,
        },
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": layers,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": bool(cfg.fc_norm),
        "norm_output": bool(cfg.norm_output),
        "torch_dtype": "float32",
    }
    with atomic_path(out_dir, is_dir=True) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(out_dir)
