"""The target as a plain HF safetensors folder (core/models/hf_folder.py) that a serving engine (vLLM, SGLang) loads.

Its `specdistill.json` names the fingerprint of the weights it came from, so a draft trained on another target is
refused before the engine sees it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specdistill.core.models.hf_folder import folder_info, hf_state, write_hf_folder


class ExportError(ValueError):
    """An export that would not serve: a missing tensor, another vocabulary, another target."""


def export_target(model: Any, tokenizer: Any, out_dir: str | Path, fingerprint: str,
                  dtype: torch.dtype = torch.float32) -> Path:
    """Write `model` (an HF causal LM) and `tokenizer` to `out_dir` as safetensors + config + tokenizer files."""
    state, config = hf_state(model, dtype)
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | (
        set() if config.get("tie_word_embeddings") else {"lm_head.weight"})
    if missing := sorted(expected - set(state)):
        raise ExportError(f"the target's state dict lacks {missing}: not a Llama-family causal LM the engine loads")
    return write_hf_folder(state, config, tokenizer, out_dir,
                           {"target_fingerprint": fingerprint, "dtype": config["dtype"]})


def exported_fingerprint(target_dir: str | Path) -> str | None:
    """The fingerprint of the weights an exported target folder came from (None for a folder not ours)."""
    return folder_info(target_dir).get("target_fingerprint")


def engine_context(target_dir: str | Path, max_model_len: int | None, key: str) -> int:
    """The context the engine serves the exported target with: `max_model_len` (the setting named `key`), or the
    target's own when None; one beyond the target's positions is refused before the engine starts."""
    import json

    from specdistill.core.errors import ConfigError

    context = json.loads((Path(target_dir) / "config.json").read_text()).get("max_position_embeddings") or 2048
    if max_model_len is not None and max_model_len > context:
        raise ConfigError(f"{key}={max_model_len} exceeds the target's context ({context} positions): lower it"
                          + (", or null for the target's own" if key == "serve.max_model_len" else ""))
    return max_model_len or context


def target_identities(target_dir: str | Path) -> set[str]:
    """Every fingerprint a draft trained on these weights may carry: the source's (e.g. the GGUF it was exported
    from) and the folder's own (a draft trained with `target.name_or_path=<this folder>`)."""
    from specdistill.core.models.target import TargetConfig, _fingerprint

    own = _fingerprint(TargetConfig(name_or_path=str(target_dir)), None)
    return {f for f in (exported_fingerprint(target_dir), own) if f}
