"""`dvc plots show` on the project's own plot definitions: one series per dataset x temperature x method."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DVC = str(Path(sys.executable).with_name("dvc"))


def definition(title: str) -> dict:
    for entry in yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]:
        if title in entry:
            return entry[title]
    raise AssertionError(f"no plot {title!r} in dvc.yaml")


def test_acceptance_by_position_draws_a_series_per_setting_and_method(tmp_path):
    d = definition("acceptance by position")
    assert d["template"] == "by_setting" and (ROOT / ".dvc/plots/by_setting.json").is_file()
    assert {Path(f).parent.name for f in d["y"]} >= {"draft", "eagle", "medusa", "lookup", "dflash"}
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([DVC, "init", "-q"], cwd=tmp_path, check=True)
    shutil.copytree(ROOT / ".dvc/plots", tmp_path / ".dvc/plots")
    rows = "setting,method,position,alpha\n" + "".join(
        f"{s},{m},{k},0.{k}\n" for s in ("humaneval/T0", "mtbench/T1") for m in ("spec", "lookup") for k in (1, 2))
    for f in ("plots/draft/alpha_by_position.csv", "plots/eagle/alpha_by_position.csv"):
        (tmp_path / f).parent.mkdir(parents=True)
        (tmp_path / f).write_text(rows)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"plots": [{"acceptance by position": {
        **d, "y": {"plots/draft/alpha_by_position.csv": "alpha", "plots/eagle/alpha_by_position.csv": "alpha"}}}]}))
    out = subprocess.run([DVC, "plots", "show", "--json"], cwd=tmp_path, capture_output=True, text=True, check=True)
    spec = json.loads(out.stdout)["data"]["acceptance by position"][0]["content"]
    # panels by dataset/temperature; within one, a colour per run and method (a file holds spec and lookup rows)
    assert spec["facet"]["field"] == "setting"
    enc = spec["spec"]["encoding"]
    assert enc["x"]["field"] == "position" and enc["y"]["field"] == "alpha" and enc["color"]["field"] == "series"
    calc = " ".join(t["calculate"] for t in spec["transform"])
    assert "datum.filename" in calc and "datum.method" in calc and "datum.rev" in calc
    series = {(r["filename"], r["method"], r["setting"]) for r in spec["data"]["values"]}
    assert len(series) == 2 * 2 * 2  # files x methods x settings: each its own line, none drawn through another
