"""The smoke experiment end to end: `dvc repro` of every stage on the real target, in a copy of the checkout.

What a new user runs first (`make repro EXPERIMENT=smoke`). Every stage runs for real (DVC, the SmolLM2 target,
Lightning, the engine), on a handful of prompts, in a temporary copy of the project's files so the checkout's
own outputs stay as they are. A stage that breaks the chain, or a limit between sections that only shows at
its stage (online requests against prepared prompts, once found after ~56 minutes), fails this test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from .helpers.checkout import copy_checkout
from .helpers.project import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.engine]
ASSETS = ROOT / "data/assets"


@pytest.fixture
def smoke_checkout(tmp_path: Path) -> Path:
    """The project's files (tracked and not ignored; no outputs, no dvc.lock) with the fetched assets."""
    proj = copy_checkout(tmp_path / "proj", skip=("reports/", "plots/", "metrics/", "dvc.lock"))
    if (ASSETS / "assets.json").exists():  # verified assets are kept by fetch_assets (persist); else it fetches them
        shutil.copytree(ASSETS, proj / "data/assets")
    subprocess.run(["git", "init", "-q"], cwd=proj, check=True)
    return proj


def run(proj: Path, *cmd: str, timeout: int) -> subprocess.CompletedProcess:
    from specdistill.engine.client import engine_python

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "WANDB_MODE": "disabled",
           "SPECDISTILL_ENGINE_PYTHON": str(engine_python())}  # the checkout's engine environment, not a copy
    return subprocess.run(list(cmd), cwd=proj, env=env, capture_output=True, text=True, timeout=timeout)


def test_smoke_runs_every_stage(smoke_checkout):
    proj = smoke_checkout
    composed = run(proj, sys.executable, "pipelines/compose.py", "experiment=smoke", timeout=300)
    assert composed.returncode == 0, composed.stderr[-3000:]
    t0 = time.perf_counter()
    repro = run(proj, "dvc", "repro", timeout=3600)
    minutes = (time.perf_counter() - t0) / 60
    assert repro.returncode == 0, (repro.stdout[-4000:], repro.stderr[-4000:])
    print(f"\nsmoke: dvc repro of every stage took {minutes:.1f} min")
    stages = yaml.safe_load((proj / "dvc.lock").read_text())["stages"]
    wanted = yaml.safe_load((proj / "dvc.yaml").read_text())["stages"]
    expected = {f"{name}@{key}" if "foreach" in spec else name
                for name, spec in wanted.items() for key in (spec.get("foreach") or [None])}
    assert expected <= set(stages), sorted(expected - set(stages))
    status = run(proj, "dvc", "status", timeout=600)
    assert "up to date" in status.stdout, status.stdout[-3000:]
    report = (proj / "reports/smoke/README.md").read_text()
    for section in ("## In the engine", "### Medusa heads", "### EAGLE heads", "## Online speculative distillation",
                    "### The engine's acceptance beside our decoder's"):
        assert section in report, section
    assert (proj / "reports/smoke/serve_speedup.png").read_bytes()[:4] == b"\x89PNG"
