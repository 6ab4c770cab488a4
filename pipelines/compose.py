"""Compose conf/ into params.yaml exactly as `dvc exp run` does (DVC's own Hydra composition).

    python pipelines/compose.py                      # the default experiment
    python pipelines/compose.py experiment=smoke generate.max_new_tokens=32

`dvc repro` reads params.yaml as it is; `dvc exp run -S ...` rewrites it itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dvc.utils.hydra import compose_and_dump

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    compose_and_dump(ROOT / "params.yaml", str(ROOT / "conf"), None, "config", str(ROOT), sys.argv[1:])
    sys.path.insert(0, str(ROOT / "src"))
    import yaml

    from specdistill.core.stage import ConfigError, cross_limits

    try:
        cross_limits(yaml.safe_load((ROOT / "params.yaml").read_text()))
    except ConfigError as e:
        sys.exit(f"error: {e} (params.yaml was written; fix the experiment or the overrides and compose again)")
    print(f"wrote {ROOT / 'params.yaml'} ({' '.join(sys.argv[1:]) or 'defaults'})")
