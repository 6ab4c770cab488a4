"""The shared front door: Hydra composes the config, the stage's library `run(cfg)` does the work.

Run by hand, a script composes `conf/` (so `-m` sweeps work); under DVC it reads the composed
`params.yaml` with `--config-dir . --config-name params`, so `dvc exp run -S ...` changes what runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # runs from a plain checkout too

from specdistill.stages.common import setup_logging  # noqa: E402


def stage_main(run: Callable[[dict[str, Any]], Any]) -> None:
    @hydra.main(version_base="1.3", config_path=str(ROOT / "conf"), config_name="config")
    def _main(cfg: DictConfig) -> None:
        setup_logging()
        run(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))

    _check_config_file(sys.argv[1:])
    _main()


def _check_config_file(argv: list[str]) -> None:
    """`--config-dir D --config-name N` (how DVC runs a stage) with no D/N.yaml: say how to make it, not
    Hydra's "Cannot find primary config"."""
    def value(flag: str) -> str | None:
        for i, arg in enumerate(argv):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        return None

    folder, name = value("--config-dir") or value("-cd"), value("--config-name") or value("-cn")
    if folder is None or name is None:
        return
    path = Path(folder) / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.exists():
        hint = ("compose it from conf/ with `make params` (or `python pipelines/compose.py`), or run "
                "`dvc exp run`, which composes it") if name in ("params", "params.yaml") else "check the name"
        sys.exit(f"error: the config {path} does not exist: {hint}")
