"""The train stage's checkpoints: where an interrupted run of the same configuration resumes, and a folder that
belongs to one configuration (its FINGERPRINT) so a changed config starts afresh."""

from __future__ import annotations

import logging
import shutil
import zipfile
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from specdistill.core.errors import ConfigError
from specdistill.core.io import has_stamp
from specdistill.core.outputs import check_replaceable

log = logging.getLogger(__name__)


def resume_point(ckpt_dir: Path, stamp: str) -> tuple[str | None, str | None]:
    """(checkpoint, W&B run id) of an interrupted run of the same configuration, else (None, None).

    `last.ckpt` when it reads whole; else the newest other checkpoint that does (a run killed, or a disk
    filled, while Lightning wrote a checkpoint leaves a truncated file); a clear error when none does.
    Read-only: every rank decides from the same files before any rank changes them; rank zero
    clears a foreign folder later (`CheckpointDir`), once all processes have started.
    """
    if not has_stamp(ckpt_dir, stamp):
        return None, None
    run_id_file = ckpt_dir / "wandb_id"
    run_id = run_id_file.read_text().strip() if run_id_file.exists() else None
    last = ckpt_dir / "last.ckpt"
    older = sorted((p for p in ckpt_dir.glob("*.ckpt") if p.name != "last.ckpt" and not p.is_symlink()),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    candidates = [p for p in (last, *older) if p.exists()]
    for i, ckpt in enumerate(candidates):
        if readable_checkpoint(ckpt):
            if i:
                log.warning("%s is damaged (cut off?): resuming from the newest whole checkpoint, %s",
                            candidates[0], ckpt)
            return str(ckpt), run_id
    if candidates:
        raise ConfigError(f"the checkpoints of this configuration in {ckpt_dir} are damaged "
                          f"({', '.join(p.name for p in candidates)}: cut off, or a full disk): none can resume. "
                          f"Delete {ckpt_dir} to train this configuration afresh")
    return None, run_id


def readable_checkpoint(path: Path) -> bool:
    """Whether a torch checkpoint (a zip archive) reads whole: every member present with its CRC."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError):
        return False


class CheckpointDir(Callback):
    """On rank zero, a fresh checkpoint folder unless this configuration resumes from it."""

    def __init__(self, ckpt_dir: Path, stamp: str, run_id: str):
        self.ckpt_dir, self.stamp, self.run_id = ckpt_dir, stamp, run_id

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.is_global_zero:
            if (self.ckpt_dir.exists() or self.ckpt_dir.is_symlink()) and not has_stamp(self.ckpt_dir, self.stamp):
                check_replaceable(self.ckpt_dir, "distill.output", markers=("FINGERPRINT",))  # ours, or refused
                log.warning("%s holds checkpoints of another configuration: starting afresh", self.ckpt_dir)
                shutil.rmtree(self.ckpt_dir)
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            (self.ckpt_dir / "FINGERPRINT").write_text(self.stamp + "\n")
            (self.ckpt_dir / "wandb_id").write_text(self.run_id + "\n")
        trainer.strategy.barrier("checkpoint-dir")
