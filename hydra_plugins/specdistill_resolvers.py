"""The project's OmegaConf resolvers for DVC's own composition of conf/ (`dvc exp run`, pipelines/compose.py): DVC
loads Hydra plugins from the repository root (its `hydra.plugins_path`), and Hydra imports every module under
hydra_plugins/, so importing this one registers them (specdistill.core.config.register_resolvers)."""

import sys
from pathlib import Path

_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:
    sys.path.append(_SRC)

from specdistill.core.config import register_resolvers  # noqa: E402

register_resolvers()
