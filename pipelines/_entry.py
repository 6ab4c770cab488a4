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

    _main()
