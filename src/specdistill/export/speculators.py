"""What every speculators-format export shares (EAGLE-3, DFlash, and Medusa's target check): the config's opening
fields, the RoPE settings engines read, and the refusal of a draft its exported target cannot serve."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdistill.export.target import ExportError, exported_fingerprint, target_identities

SPECULATORS_VERSION = "0.9.0"


def _relative_to_project(path: Path) -> str:
    path = path.resolve()
    root = Path.cwd().resolve()
    return os.path.relpath(path, root) if root in path.parents else str(path)


def check_against_target(cfg: Any, target_dir: Path) -> dict[str, Any]:
    """The exported target's config, after refusing a draft it cannot serve (before any engine sees it)."""
    if not (target_dir / "config.json").exists():
        raise ExportError(f"no exported target at {target_dir} (config.json missing): run the export stage for the "
                          f"target first (`dvc repro export_target`)")
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


def is_speculators_folder(path: str | Path) -> bool:
    """A speculators-format folder (any trainer's: ours, `speculators train`'s): config.json names its model type."""
    config = Path(path) / "config.json"
    return config.exists() and "speculators_model_type" in json.loads(config.read_text())


def check_verifier(path: Path, config: dict[str, Any], target: Any, target_fingerprint: str | None,
                   error: type[Exception]) -> None:
    """Refuse a speculators checkpoint for another verifier than `target` (the HF model): another vocabulary or
    width, or an exported target of ours whose fingerprint is not this target's (it reads that target's states)."""
    layer = config["transformer_layer_config"]
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    where = f"{path} (verifier {verifier.get('name_or_path')!r})"
    width = config.get("target_hidden_size") or layer["hidden_size"]
    t = target.config
    if layer["vocab_size"] != t.vocab_size or width != t.hidden_size:
        raise error(f"{where} drafts for a verifier of vocabulary {layer['vocab_size']} and width {width}; this "
                    f"target has {t.vocab_size} and {t.hidden_size}: evaluate it with the target it was trained on")
    named = Path(str(verifier.get("name_or_path") or ""))
    trained_on = exported_fingerprint(named) if named.is_dir() else None
    if trained_on and target_fingerprint and target_fingerprint not in target_identities(named):
        raise error(f"{where} names an exported target of fingerprint {trained_on[:24]}..., and this target is "
                    f"{target_fingerprint[:24]}...: it reads that target's hidden states; evaluate it with that target")


def read_state(path: Path, config: dict[str, Any], prefix: tuple[str, str], error: type[Exception]
               ) -> tuple[dict[str, Any], int | None]:
    """A speculators folder's tensors under our names (`prefix`: (theirs, ours), e.g. layers.0. -> midlayer.), with
    d2t back to target ids and what the engine keeps apart dropped (t2d, embeddings, the verifier's); and the reduced
    draft vocabulary's size (None: the full vocabulary)."""
    import torch
    from safetensors.torch import load_file

    state = {k.replace(prefix[0], prefix[1], 1): v for k, v in load_file(str(path / "model.safetensors")).items()
             if k not in ("t2d", "embed_tokens.weight") and not k.startswith("verifier")}
    vocab = config["transformer_layer_config"]["vocab_size"]
    draft_vocab = config.get("draft_vocab_size") or vocab
    if "d2t" in state:
        state["d2t"] = state["d2t"].long() + torch.arange(len(state["d2t"]))  # offsets -> target ids
        return state, draft_vocab
    if draft_vocab != vocab:
        raise error(f"{path}: a reduced draft vocabulary ({draft_vocab}) without its d2t map")
    return state, None


def layer_fields(config: dict[str, Any], target: Any, eps: float) -> dict[str, Any]:
    """The decoder layer's sizes a speculators config states (`transformer_layer_config`), under our configs' names,
    with the defaults its model type takes where a field is left out (`eps`: its RMSNorm epsilon)."""
    layer = config["transformer_layer_config"]
    heads = layer["num_attention_heads"]
    return {"hidden_size": layer["hidden_size"], "intermediate_size": layer["intermediate_size"],
            "num_attention_heads": heads, "num_key_value_heads": layer.get("num_key_value_heads") or heads,
            "head_dim": layer.get("head_dim") or layer["hidden_size"] // heads,
            "rms_norm_eps": layer.get("rms_norm_eps", eps),
            "max_position_embeddings": layer.get("max_position_embeddings", target.config.max_position_embeddings),
            "rope_parameters": layer.get("rope_parameters"), "vocab_size": layer["vocab_size"]}
