"""`dvc plots show` on the project's own plot definitions: the report stage gathers each item's series into one file per
view (reporting/series.py), and every plot dvc.yaml declares renders from them, a line per item (and per dataset x
temperature x method where the view has them)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from specdistill.reporting.series import write_series

ROOT = Path(__file__).resolve().parents[1]
DVC = str(Path(sys.executable).with_name("dvc"))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_every_declared_plot_renders_a_line_per_item(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([DVC, "init", "-q"], cwd=tmp_path, check=True)
    shutil.copytree(ROOT / ".dvc/plots", tmp_path / ".dvc/plots")
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"plots": plots}))
    (tmp_path / "params.yaml").write_text("experiment_name: x\n")
    # what the items draw: two evaluate items (each with its spec and a companion's rows), two train items, an online
    rows = "setting,method,position,alpha\n" + "".join(
        f"{s},{m},{k},0.{k}\n" for s in ("humaneval/T0", "mtbench/T1") for m in ("spec", "lookup") for k in (1, 2))
    for item in ("draft", "eagle"):
        write(tmp_path / f"plots/x/{item}/alpha_by_position.csv", rows)
        write(tmp_path / f"plots/x/train_{item}/val.csv", "step,alpha,alpha_t0,tau_sim\n1,0.2,0.1,1.2\n2,0.3,0.2,1.3\n")
    write(tmp_path / "plots/x/online_eagle/curve.csv", "request,frozen_window,online_window\n1,0.4,0.4\n2,0.4,0.5\n")
    assert write_series(tmp_path / "plots/x", tmp_path / "reports/x/series") == [
        "alpha_by_position.csv", "val_alpha.csv", "online_alpha.csv"]

    out = subprocess.run([DVC, "plots", "show", "--json"], cwd=tmp_path, capture_output=True, text=True, check=True)
    shown = json.loads(out.stdout)
    assert not shown.get("errors"), shown["errors"]
    titles = [next(iter(p)) for p in plots]
    assert set(shown["data"]) == set(titles)

    by_position = shown["data"]["acceptance by position"][0]["content"]
    assert by_position["facet"]["field"] == "setting"  # a panel per dataset x temperature
    enc = by_position["spec"]["encoding"]
    assert enc["x"]["field"] == "position" and enc["y"]["field"] == "alpha" and enc["color"]["field"] == "series"
    values = by_position["data"]["values"]
    assert {(r["item"], r["method"], r["setting"]) for r in values} == {
        (i, m, s) for i in ("draft", "eagle") for m in ("spec", "lookup") for s in ("humaneval/T0", "mtbench/T1")}

    curves = shown["data"]["acceptance curve (validation, against training step)"][0]["content"]
    assert {(r["item"], r["series"]) for r in curves["data"]["values"]} == {
        (f"train_{i}", t) for i in ("draft", "eagle") for t in ("T=1", "T=0")}
    assert curves["encoding"]["color"]["field"] == "line"
    online = shown["data"]["online distillation (acceptance, moving window, against request)"][0]["content"]
    assert {r["series"] for r in online["data"]["values"]} == {"frozen", "online"}


def test_no_series_without_items(tmp_path):
    assert write_series(tmp_path / "plots", tmp_path / "series") == []
