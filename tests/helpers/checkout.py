"""A temporary copy of the project to run stages in (the `checkout` fixture in conftest makes one), the config its
conf/ composes, a stage's entry point, and a digest of every file to check that nothing changed."""

from __future__ import annotations

import hashlib
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from .project import ROOT


def copy_checkout(dest: Path, skip: tuple[str, ...] = ("reports/", "plots/", "metrics/")) -> Path:
    """The project's files (tracked, and untracked ones git does not ignore) copied to `dest`, without the
    outputs under `skip`: a checkout to run stages in without touching this one."""
    import shutil
    import subprocess

    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file() and not f.startswith(skip):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def composed(proj: Path, *overrides: str) -> dict:
    with initialize_config_dir(str(proj / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=["logger=none", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def stage_run(name: str):
    from importlib import import_module

    return import_module(f"specdistill.stages.{name}").run
