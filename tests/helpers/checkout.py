"""A temporary copy of the project to run stages in (the `checkout` fixture in conftest makes one), the config its
conf/ composes, a stage's entry point, and a digest of every file to check that nothing changed."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
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


def repro_checkout(dest: Path) -> Path:
    """A copy to `dvc repro` in: the project's files without any outputs or dvc.lock, with the fetched assets (verified
    assets are kept by fetch_assets, `persist`; without them it fetches), and a git repository for DVC."""
    import shutil
    import subprocess

    proj = copy_checkout(dest, skip=("reports/", "plots/", "metrics/", "dvc.lock"))
    assets = ROOT / "data/assets"
    if (assets / "assets.json").exists():
        shutil.copytree(assets, proj / "data/assets")
    subprocess.run(["git", "init", "-q"], cwd=proj, check=True)
    return proj


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


def repro_env(require_engine: bool = True) -> dict[str, str]:
    """The environment to `dvc repro` a copy in: this venv's `dvc` and python first, W&B off, and the checkout's own
    engine environment (not a copy's). Without one: an error, or (require_engine=False) the engine stages' own."""
    import os
    import sys

    from specdistill.engine.client import engine_python

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "WANDB_MODE": "disabled"}
    try:
        env["SPECDISTILL_ENGINE_PYTHON"] = str(engine_python())
    except Exception:
        if require_engine:
            raise
    return env


def timed_repro(proj: Path, env: dict[str, str], timeout: float,
                on_stage: Callable[[str, float], None] | None = None,
                targets: Sequence[str] = ()) -> tuple[int, str, dict[str, float]]:
    """`dvc repro [targets]` in `proj`, as `make repro` runs it: its exit code, its output, and each stage's minutes
    (from its "Running stage" line to the next stage's or the end), so a slow run says where its time went.
    Killed after `timeout` seconds (-9).
    `on_stage(name, minutes since the start)` as each stage starts: progress for a long run."""
    import os
    import signal
    import subprocess
    import threading
    import time

    command = ["dvc", "repro", *targets]
    proc = subprocess.Popen(command, cwd=proj, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    watchdog = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))  # dvc and its stage too
    watchdog.start()
    lines: list[str] = []
    minutes: dict[str, float] = {}
    start = since = time.perf_counter()
    stage: str | None = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Running stage '"):
                now = time.perf_counter()
                if stage:
                    minutes[stage] = (now - since) / 60
                stage, since = line.split("'")[1], now
                if on_stage:
                    on_stage(stage, (now - start) / 60)
        code = proc.wait()
    finally:
        watchdog.cancel()
    if stage:
        minutes[stage] = (time.perf_counter() - since) / 60
    return code, "".join(lines), minutes


def minutes_table(minutes: dict[str, float]) -> str:
    """Each stage's minutes, then each foreach stage's sum (train, evaluate, ...) and the total."""
    groups: dict[str, float] = {}
    for stage, m in minutes.items():
        group = stage.split("@")[0]
        groups[group] = groups.get(group, 0.0) + m
    rows = [f"{s:28s} {m:6.2f}" for s, m in minutes.items()]
    rows += ["-" * 35] + [f"{g:28s} {m:6.2f}" for g, m in groups.items()]
    return "\n".join(rows + [f"{'total':28s} {sum(minutes.values()):6.2f}"])
