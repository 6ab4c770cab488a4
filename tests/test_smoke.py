"""The smoke experiment end to end: `dvc repro` on the real target, in a copy of the checkout.

What a new user runs first (`make repro EXPERIMENT=smoke`), as that runs it: DVC starts each item as a process of its
own. Every stage runs for real (DVC, the SmolLM2 target, Lightning, the engine), on a handful of prompts, in a
temporary copy of the project's files so the checkout's own outputs stay as they are. A stage that breaks the chain,
or a limit between sections that only shows at its stage (online requests against prepared prompts, once found after
~56 minutes), fails this test.

CI runs one item of each stage (`ONE_PER_STAGE` and what they need, then the report over what they wrote): the chain
is the same code for every item, and each method's own train / evaluate / export path runs in-process on tiny
models in its own tests (test_train, test_evaluate, test_export, test_eagle, test_medusa, test_dflash, test_online,
test_engine). `make test-full` runs every item (`test_smoke_runs_every_item`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .helpers.checkout import minutes_table, repro_checkout, repro_env, timed_repro

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.smoke]

# one item of each foreach stage, chosen so that what they need is few items more: EAGLE-3's chain (features, train,
# evaluate, online, export beside the target, serve), compare, which needs its four rivals trained, and speculators'
# EAGLE-3 trained on the same data and served by the engine (reference, then serve), and the EAGLE-3 head learning
# inside the engine (online_engine; the separate draft's item would train train@draft_full for it alone, and
# tests/test_online_engine.py runs that stage on it)
ONE_PER_STAGE = ("evaluate@eagle", "compare", "online@eagle", "serve@eagle", "serve@ref_eagle_matched",
                 "online_engine@eagle")
SECTIONS = ("## In the engine", "### EAGLE heads", "## Online speculative distillation",
            "### The engine's acceptance beside our decoder's", "## Against the reference trainer",
            "### Inside the engine")


@pytest.fixture
def smoke_checkout(tmp_path: Path) -> Path:
    """The project's files (tracked and not ignored; no outputs, no dvc.lock) with the fetched assets, and the
    smoke experiment's params.yaml."""
    proj = repro_checkout(tmp_path / "proj")
    composed = run(proj, sys.executable, "pipelines/compose.py", "experiment=smoke", timeout=300)
    assert composed.returncode == 0, composed.stderr[-3000:]
    return proj


def run(proj: Path, *cmd: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=proj, env=repro_env(), capture_output=True, text=True, timeout=timeout)


def items_of(dvc_yaml: Path) -> set[str]:
    """Every item dvc.yaml declares (`stage@key` for a foreach stage)."""
    wanted = yaml.safe_load(dvc_yaml.read_text())["stages"]
    return {f"{name}@{key}" if "foreach" in spec else name
            for name, spec in wanted.items() for key in (spec.get("foreach") or [None])}


def check_records(proj: Path) -> None:
    # the engine worker is serve's child: its CPU counts as serve's own, so a quiet machine reads as quiet
    records = list((proj / "metrics/smoke/records").glob("serve_*.json"))
    assert records
    for record in records:
        share = json.loads(record.read_text())["settings"].get("others_cpu_share")
        assert share is not None and share < 0.5, (record.name, share)


def test_smoke_runs_one_item_of_every_stage(smoke_checkout):
    proj = smoke_checkout
    code, out, minutes = timed_repro(proj, repro_env(), timeout=3600, targets=ONE_PER_STAGE)
    if code == 0:  # the report over what those items wrote, as `make repro STAGES=...` leaves it to `-s report`
        code, more, after = timed_repro(proj, repro_env(), timeout=600, targets=("--single-item", "report"))
        out, minutes = out + more, {**minutes, **after}
    print("\nsmoke, one item per stage: minutes per item of `dvc repro`\n" + minutes_table(minutes))
    assert code == 0, (out[-6000:], minutes_table(minutes))
    ran = set(yaml.safe_load((proj / "dvc.lock").read_text())["stages"])
    stages = {item.split("@")[0] for item in items_of(proj / "dvc.yaml")}
    assert stages <= {item.split("@")[0] for item in ran}, sorted(stages - {i.split("@")[0] for i in ran})
    check_records(proj)
    status = run(proj, "dvc", "status", *ONE_PER_STAGE, "report", timeout=600)
    assert status.returncode == 0 and "changed" not in status.stdout, status.stdout[-3000:]
    report = (proj / "reports/smoke/README.md").read_text()
    for section in SECTIONS:
        assert section in report, section
    assert (proj / "reports/smoke/serve_speedup.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.full
def test_smoke_runs_every_item(smoke_checkout):
    proj = smoke_checkout
    code, out, minutes = timed_repro(proj, repro_env(), timeout=3600)
    print("\nsmoke, every item: minutes per stage of `dvc repro`\n" + minutes_table(minutes))
    assert code == 0, (out[-6000:], minutes_table(minutes))
    assert items_of(proj / "dvc.yaml") <= set(yaml.safe_load((proj / "dvc.lock").read_text())["stages"])
    check_records(proj)
    status = run(proj, "dvc", "status", timeout=600)
    assert "up to date" in status.stdout, status.stdout[-3000:]
    report = (proj / "reports/smoke/README.md").read_text()
    for section in (*SECTIONS, "### Medusa heads"):
        assert section in report, section
