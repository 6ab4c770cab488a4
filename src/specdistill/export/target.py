"""The target as a plain HF safetensors folder: what a serving engine (vLLM, SGLang) and `transformers` load.

A GGUF-loaded target refuses `save_pretrained` ("quantized with gguf ... not serializable"), so the folder is
written here by hand: the dequantised state dict (as loaded, at `dtype`), the config without its quantisation
entry, the tokenizer with its chat template, and a `specdistill.json` naming the fingerprint of the weights it
came from, so a draft trained on another target is refused before the engine sees it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdistill.io import atomic_path

EXPORT_INFO = "specdistill.json"


class ExportError(ValueError):
    """An export that would not serve: a missing tensor, another vocabulary, another target."""


def export_target(model: Any, tokenizer: Any, out_dir: str | Path, fingerprint: str,
                  dtype: torch.dtype = torch.float32) -> Path:
    """Write `model` (an HF causal LM) and `tokenizer` to `out_dir` as safetensors + config + tokenizer files."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    tied = bool(config.get("tie_word_embeddings"))
    if tied:  # one tensor in memory; safetensors keeps no aliases, and a loader ties it again from the config
        state.pop("lm_head.weight", None)
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {"lm_head.weight"})
    if missing := sorted(expected - set(state)):
        raise ExportError(f"the target's state dict lacks {missing}: not a Llama-family causal LM the engine loads")
    with atomic_path(out_dir, is_dir=True) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        tokenizer.save_pretrained(str(tmp))
        (tmp / EXPORT_INFO).write_text(json.dumps({"target_fingerprint": fingerprint, "dtype": config["dtype"]},
                                                  indent=2, sort_keys=True) + "\n")
    return out_dir


def exported_fingerprint(target_dir: str | Path) -> str | None:
    """The fingerprint of the weights an exported target folder came from (None for a folder not ours)."""
    info = Path(target_dir) / EXPORT_INFO
    return json.loads(info.read_text()).get("target_fingerprint") if info.exists() else None


def target_identities(target_dir: str | Path) -> set[str]:
    """Every fingerprint a draft trained on these weights may carry: the source's (e.g. the GGUF it was exported
    from) and the folder's own (a draft trained with `target.name_or_path=<this folder>`)."""
    from specdistill.models.target import TargetConfig, _fingerprint

    own = _fingerprint(TargetConfig(name_or_path=str(target_dir)), None)
    return {f for f in (exported_fingerprint(target_dir), own) if f}
