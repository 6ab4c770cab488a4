"""The committed results as a user meets them on a fresh clone (issue 57): `dvc metrics show` fits a terminal,
`dvc plots show` renders every declared plot, and the default experiment's records come from one run: one code
version and one machine. On the committed files, not on a scratch copy: these fail when a partial rerun or an
old-layout metrics file is committed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from specdistill.core.records import read_records
from specdistill.stages.report import machine

from .helpers.project import ROOT

DVC = str(Path(sys.executable).with_name("dvc"))
EXPERIMENT = yaml.safe_load((ROOT / "params.yaml").read_text())["experiment_name"]


def dvc(*args: str) -> str:
    return subprocess.run([DVC, *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300).stdout


def test_dvc_metrics_show_fits_a_200_column_terminal():
    out = dvc("metrics", "show")
    lines = out.splitlines()
    assert len(lines) > 10, out  # a table of the experiment's headline files, not an empty one
    widest = max(lines, key=len)
    assert len(widest) <= 200, f"{len(widest)} characters: {widest[:300]}"
    assert f"metrics/{EXPERIMENT}/records" not in out  # whole records stay out of the table


def test_dvc_plots_show_renders_every_declared_plot_from_the_committed_series():
    shown = json.loads(dvc("plots", "show", "--json"))
    assert not shown.get("errors"), shown["errors"]
    declared = [next(iter(p)) for p in yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]]
    assert set(shown["data"]) == set(declared)
    for title in declared:
        values = shown["data"][title][0]["content"]["data"]["values"]
        assert values, f"{title!r} renders no points from reports/{EXPERIMENT}/series"


def test_the_experiments_records_come_from_one_code_version_and_one_machine():
    records = read_records(ROOT / "metrics" / EXPERIMENT)
    assert len(records) > 20, sorted(records)
    settings = {name: r.get("settings") or {} for name, r in records.items()}
    code = {name: s.get("code") for name, s in settings.items()}
    assert len(set(code.values())) == 1 and None not in code.values(), code
    assert "+changes" not in next(iter(code.values())), code  # committed code, which a clone can check out
    machines = {name: machine(s) for name, s in settings.items() if s.get("device")}  # as the report names them
    assert len(machines) > 20 and len(set(machines.values())) == 1, machines
