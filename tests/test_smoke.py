"""The smoke experiment end to end: `dvc repro` of every stage on the real target, in a copy of the checkout.

What a new user runs first (`make repro EXPERIMENT=smoke`), run as that runs it: beside the fork server, so each
stage item starts warm (`specdistill.forkserver`). Every stage runs for real (DVC, the SmolLM2 target,
Lightning, the engine), on a handful of prompts, in a temporary copy of the project's files so the checkout's
own outputs stay as they are. A stage that breaks the chain, or a limit between sections that only shows at
its stage (online requests against prepared prompts, once found after ~56 minutes), fails this test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .helpers.checkout import minutes_table, repro_checkout, repro_env, timed_repro

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture
def smoke_checkout(tmp_path: Path) -> Path:
    """The project's files (tracked and not ignored; no outputs, no dvc.lock) with the fetched assets."""
    return repro_checkout(tmp_path / "proj")


def run(proj: Path, *cmd: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=proj, env=repro_env(), capture_output=True, text=True, timeout=timeout)


def test_smoke_runs_every_stage(smoke_checkout):
    proj = smoke_checkout
    composed = run(proj, sys.executable, "pipelines/compose.py", "experiment=smoke", timeout=300)
    assert composed.returncode == 0, composed.stderr[-3000:]
    code, out, minutes = timed_repro(proj, repro_env(), timeout=3600)
    print("\nsmoke: minutes per stage of `dvc repro`\n" + minutes_table(minutes))
    assert code == 0, (out[-6000:], minutes_table(minutes))
    # as `make repro` runs it: every stage item, and every engine worker, forked from a warm server
    # (specdistill.forkserver: one in .venv, one in .venv-engine), none cold
    assert out.count("stage scripts fork from here") == 2 and "running cold" not in out, out[-6000:]
    # the warm engine worker is the server's child, not serve's: its CPU still counts as serve's own (credited),
    # else the engine's work reads as others' (78% when it did not)
    for record in (proj / "metrics/smoke/records").glob("serve_*.json"):
        share = json.loads(record.read_text())["settings"].get("others_cpu_share")
        assert share is not None and share < 0.5, (record.name, share)
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
