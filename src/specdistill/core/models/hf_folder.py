"""An HF causal LM as a plain safetensors folder: what `transformers` and a serving engine (vLLM, SGLang) load.

A GGUF-loaded model refuses `save_pretrained` ("quantized with gguf ... not serializable"), so the folder is written
here by hand: the state dict as loaded (at `dtype`), the config without its quantisation entry, the tokenizer with
its chat template, and `specdistill.json` saying where the weights came from. Used by the export stage (the
engine-ready target) and by the dequantised-target cache (core/models/dequantised.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdistill.core.io import atomic_path

INFO = "specdistill.json"


def hf_state(model: Any, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state dict at `dtype` and the config as written (a tied output head is not stored twice: safetensors
    keeps no aliases, and a loader ties it again from the config)."""
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    return state, config


def write_hf_folder(state: dict[str, torch.Tensor], config: dict[str, Any], tokenizer: Any, out_dir: str | Path,
                    info: dict[str, Any]) -> Path:
    """Write the folder whole (under a temporary name, renamed when complete)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        tokenizer.save_pretrained(str(tmp))
        (tmp / INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out_dir


def folder_info(folder: str | Path) -> dict[str, Any]:
    """What `write_hf_folder` recorded about the weights ({} for a folder not written by it)."""
    info = Path(folder) / INFO
    return json.loads(info.read_text()) if info.exists() else {}
