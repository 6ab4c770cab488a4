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
import os
from pathlib import Path
from typing import Any

import torch

from specdistill.export.target import ExportError, exported_fingerprint, target_identities
from specdistill.io import atomic_path

SPECULATORS_VERSION = "0.9.0"


def _relative_to_project(path: Path) -> str:
    path = path.resolve()
    root = Path.cwd().resolve()
    return os.path.relpath(path, root) if root in path.parents else str(path)


def check_against_target(cfg: Any, target_dir: Path) -> dict[str, Any]:
    """The exported target's config, after refusing a draft it cannot serve (before any engine sees it)."""
    if not (target_dir / "config.json").exists():
        raise ExportError(f"no exported target at {target_dir} (config.json missing): run the export stage for the "
                          f"target first (`dvc repro export@target`)")
    t = json.loads((target_dir / "config.json").read_text())
    for ours, theirs in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                         ("target_num_layers", "num_hidden_layers")):
        if getattr(cfg, ours, None) is not None and getattr(cfg, ours) != t.get(theirs):
            raise ExportError(f"the draft was trained for a target with {theirs}={getattr(cfg, ours)}, the target at "
                              f"{target_dir} has {t.get(theirs)}: export the target it was trained on")
    trained_on = getattr(cfg, "target_fingerprint", None)
    if trained_on and exported_fingerprint(target_dir) and trained_on not in target_identities(target_dir):
        raise ExportError(f"the draft was trained on target {trained_on[:24]}..., the folder {target_dir} holds "
                          f"{exported_fingerprint(target_dir)[:24]}...: it reads that target's hidden states, so "
                          f"serve it with its own target")
    return t


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


def rope_parameters(cfg: Any, target_config: dict[str, Any]) -> dict[str, Any]:
    """The draft's RoPE settings (its own, else the target's), with the theta and type engines read."""
    rope = dict(cfg.rope_parameters or target_config.get("rope_parameters") or {})
    if "rope_theta" not in rope and target_config.get("rope_theta") is not None:
        rope["rope_theta"] = target_config["rope_theta"]
    rope.setdefault("rope_type", "default")
    return rope


def speculators_header(algorithm: str, architecture: str, k: int, target_dir: Path, target_config: dict[str, Any]
                       ) -> dict[str, Any]:
    """What every speculators config opens with: its type and version, and the proposal and verifier it names."""
    return {
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "architectures": [architecture],
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": _relative_to_project(target_dir),
                         "architectures": list(target_config.get("architectures") or ["LlamaForCausalLM"])},
        },
    }


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
