"""What every benchmark shares: the project root on the path, and the pipeline's own target settings."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def target_config(dtype: str, path: str | Path | None = None) -> dict[str, Any]:
    """The composed target of params.yaml (what `dvc repro` loads), at `dtype` and optionally another path:
    the benchmarks measure the pipeline's target, so they read its settings instead of a copy."""
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())["target"]
    return {**cfg, "name_or_path": str(path or ROOT / cfg["name_or_path"]), "dtype": dtype}
