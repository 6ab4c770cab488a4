"""Saving and loading the heads that live on a frozen target (Medusa, EAGLE): a config that names the
target, safetensors weights, the training settings; refused on load for another target."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

SETTINGS_FILE = "specdistill.json"


def write_heads(folder: Path, module: nn.Module, cfg: Any, config_file: str, weights_file: str,
                extra: dict[str, Any] | None = None) -> None:
    """Into `folder` (an `atomic_path` temporary): weights, the config dataclass and the settings."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}, str(folder / weights_file))
    (folder / config_file).write_text(json.dumps(asdict(cfg), indent=2, sort_keys=True) + "\n")
    if extra:
        write_settings(folder, extra)


def write_settings(folder: str | Path, settings: dict[str, Any]) -> None:
    """The training settings beside a saved draft or heads (what `read_settings` and a run's lineage read)."""
    (Path(folder) / SETTINGS_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True, default=str) + "\n")


def read_settings(path: str | Path | None) -> dict[str, Any]:
    """The training settings saved beside a draft or heads folder ({} when there are none)."""
    meta = Path(path) / SETTINGS_FILE if path else None
    return json.loads(meta.read_text()) if meta is not None and meta.exists() else {}


def read_heads(path: str | Path, config_cls: type, config_file: str, weights_file: str, error: type[Exception],
               what: str, stage: str, target_fingerprint: str | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, tensors) of a heads folder; `error` when it is missing or was trained on another target:
    heads read the target's hidden states, so another target's heads are noise."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / config_file).exists():
        raise error(f"no {what} at {path}: train it first (`dvc repro {stage}`) or fix the path in the config")
    cfg = config_cls(**json.loads((path / config_file).read_text()))
    trained_on = getattr(cfg, "target_fingerprint", None)
    if target_fingerprint and trained_on and trained_on != target_fingerprint:
        raise error(f"the {what} at {path} was trained on target {trained_on}, not this one ({target_fingerprint}): "
                    f"it reads the target's hidden states, so retrain it (`dvc repro {stage}`)")
    return cfg, load_file(str(path / weights_file))


def parameter_bytes(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(parameters, bytes at `dtype`) of the weights a decoder holds for this module."""
    n = sum(p.numel() for p in module.parameters())
    return n, n * torch.finfo(dtype).bits // 8
