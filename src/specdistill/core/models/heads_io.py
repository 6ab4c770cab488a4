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


def training_summary(path: str | Path | None) -> dict[str, Any] | None:
    """How a trained draft or heads folder was made (method, size, loss, init, data), from its settings file."""
    s = read_settings(path)
    if not s:
        return None
    # the draft size is the separate draft's section (conf/draft/), which only it records; a folder written before
    # methods were named is the separate draft's
    return {"method": s.get("method", {}).get("name", "draft"), "draft_size": (s.get("draft") or {}).get("name"),
            "loss": s.get("loss", {}).get("name"), "init": s.get("method", {}).get("init"),
            "data": s.get("distill", {}).get("data", {}).get("source")}


def read_heads(path: str | Path, config_cls: type, config_file: str, weights_file: str, error: type[Exception],
               what: str, stage: str, target_fingerprint: str | None = None,
               target: nn.Module | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, tensors) of a heads folder; `error` when it is missing, unreadable, or made for another target:
    heads read the target's hidden states, so another target's heads are noise. Heads saved without a
    fingerprint are still checked against `target`'s width and vocabulary, which a matmul would otherwise
    find much later and less clearly."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / config_file).exists():
        raise error(f"no {what} at {path}: train it first (`dvc repro {stage}`) or fix the path in the config")
    try:
        cfg = config_cls(**json.loads((path / config_file).read_text()))
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
        raise error(f"{path / config_file} is not a {what} config ({e}): retrain (`dvc repro {stage}`)") from None
    trained_on = getattr(cfg, "target_fingerprint", None)
    if target_fingerprint and trained_on and trained_on != target_fingerprint:
        raise error(f"the {what} at {path} was trained on target {trained_on}, not this one ({target_fingerprint}): "
                    f"it reads the target's hidden states, so retrain it (`dvc repro {stage}`)")
    if target is not None:
        width, vocab = target.config.hidden_size, target.get_input_embeddings().weight.shape[0]
        if (cfg.hidden_size, cfg.vocab_size) != (width, vocab):
            raise error(f"the {what} at {path} are for a target of width {cfg.hidden_size} and vocabulary "
                        f"{cfg.vocab_size}; this target has {width} and {vocab}: train heads for it "
                        f"(`dvc repro {stage}`)")
    try:
        return cfg, load_file(str(path / weights_file))
    except (SafetensorError, OSError) as e:
        raise error(f"{path / weights_file} is not a readable safetensors file ({e}): it was cut off or damaged; "
                    f"retrain (`dvc repro -f {stage}`) or restore it (`dvc checkout`)") from None


def load_state(module: nn.Module, state: dict[str, torch.Tensor], path: str | Path, what: str, stage: str,
               error: type[Exception]) -> None:
    """`module.load_state_dict(state)` with an error that names the folder when the shapes disagree."""
    try:
        module.load_state_dict(state)
    except RuntimeError as e:
        raise error(f"the weights at {path} do not fit the {what} their config describes ({str(e).splitlines()[0]} "
                    f"...): the folder mixes two trainings; retrain (`dvc repro -f {stage}`)") from None


def parameter_bytes(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(parameters, bytes at `dtype`) of the weights a decoder holds for this module."""
    n = sum(p.numel() for p in module.parameters())
    return n, n * torch.finfo(dtype).bits // 8
