"""W&B runs for every stage: offline unless told otherwise, rank zero only, always finished.

One convention: `job_type` is the stage (fetch_assets, prepare, generate, features, train, evaluate, online, export,
serve, report), the run's name is the DVC stage's (`evaluate@eagle`; a sweep job's name is its overrides), and
the group is the experiment.

`WANDB_MODE` in the environment wins over the config, so `WANDB_MODE=online` syncs a run for a user
with an account and `WANDB_MODE=disabled` silences it; offline runs land in `<dir>/wandb/` and can be
synced later with `wandb sync`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specdistill.core.outputs import is_rank_zero

log = logging.getLogger(__name__)


class _NoRun:
    """Stands in for a run when logging is off or on ranks other than zero: every call is a no-op."""

    dir = None

    def __init__(self) -> None:
        self.summary: dict[str, Any] = {}  # per instance: a class-level dict would leak between runs

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass

    def finish(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_artifact(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextlib.contextmanager
def wandb_run(logger_cfg: dict[str, Any] | None, *, job_type: str, group: str, config: dict[str, Any],
              name: str | None = None) -> Iterator[Any]:
    """A W&B run for one stage; finished with exit code 1 if the block raises."""
    cfg = dict(logger_cfg or {})
    if not cfg.get("enabled", False) or not is_rank_zero():
        yield _NoRun()
        return
    import wandb

    mode = os.environ.get("WANDB_MODE", cfg.get("mode", "offline"))
    out_dir = cfg.get("dir", ".")
    os.makedirs(out_dir, exist_ok=True)
    run = wandb.init(
        project=cfg.get("project", "specdistill"),
        entity=cfg.get("entity"),
        group=group,
        job_type=job_type,
        name=name or job_type,
        tags=list(cfg.get("tags") or []),
        config=config,
        mode=mode,
        dir=out_dir,
        reinit="create_new",  # multirun jobs in one process get one run each, never a merged one
    )
    try:
        yield run
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()


def log_folder(run: Any, folder: str | Path, name: str, kind: str = "model") -> None:
    """A folder the stage wrote, as a W&B artifact by reference: its files' checksums and paths, no copy (DVC
    keeps the bytes; an artifact per model would double the disk a sweep takes)."""
    if run.dir is None:  # logging is off
        return
    import wandb

    art = wandb.Artifact(name.replace("@", "-"), type=kind)
    art.add_reference(Path(folder).resolve().as_uri())
    run.log_artifact(art)


def lightning_logger(logger_cfg: dict[str, Any] | None, run_id: str, run_name: str, group: str,
                  config: dict[str, Any]) -> Any:
    """Lightning's W&B logger for a train run (rank zero logs; a resumed stage continues its run by `run_id`), or
    False when logging is off."""
    cfg = dict(logger_cfg or {})
    if not cfg.get("enabled", False):
        return False
    from lightning.pytorch.loggers import WandbLogger

    os.makedirs(cfg.get("dir", "."), exist_ok=True)
    mode = os.environ.get("WANDB_MODE", cfg.get("mode", "offline"))
    return WandbLogger(project=cfg.get("project", "specdistill"), entity=cfg.get("entity"), group=group,
                       job_type="train", name=run_name, tags=list(cfg.get("tags") or []), mode=mode,
                       save_dir=cfg.get("dir", "."), id=run_id, resume="allow", config=config)
