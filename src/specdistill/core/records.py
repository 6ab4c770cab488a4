"""Metrics files a terminal can read: the headline numbers in `metrics/<name>.json`, the whole record beside them.

`dvc metrics show` and `dvc exp show` print every number of every declared metrics file as a column, so records
that carried their settings, environment, per-shard timings and every result cell made lines of ~45,000
characters. A stage therefore writes two files:

- `metrics/<name>.json`: the few numbers one compares across runs and experiments (declared `metrics:` in
  dvc.yaml), e.g. an evaluation's tau at T=0 and its speed-up; stages share names (tokens_per_s, speedup), so
  the whole table of the default experiment stays under 200 columns;
- `metrics/records/<name>.json`: the whole record, settings included (a plain output), which the report, resumes
  and the tests read.

A record written before the split is its own headline file: `read_record` reads either.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

from specdistill.core.io import write_json

RECORDS = "records"


CODE_PATHS = ("src", "pipelines", "conf", "engine-plugin")  # what a stage runs; not the data and results it writes


@functools.cache
def code_version() -> str | None:
    """The code a process runs: the last commit that changed CODE_PATHS (a commit of docs or results keeps the
    version), with "+changes.<hash of the uncommitted changes>" where the checkout's code differs from it; None
    outside a git checkout of the project (an installed package). Cached: a stage asks at its start
    (pipelines/_entry.py), so its record names the code it started with, not what the checkout holds hours later."""
    return commit_of(Path(__file__).resolve().parents[3])


def commit_of(root: Path) -> str | None:
    """`code_version` of the checkout at `root`."""
    if not (root / "src" / "specdistill").is_dir():
        return None
    # the checkout's own git: no GIT_DIR / GIT_INDEX_FILE of a hook or `git rebase -x` around us, and no index lock
    # taken (a `git commit` beside a running stage must not fail on it)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | {"GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                              timeout=30, env=env).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None  # a copy of the code inside another repository: that repository's commits are not its
        head = git("log", "-1", "--format=%h", "--abbrev=12", "--", *CODE_PATHS)
        diff = git("diff", "HEAD", "--", *CODE_PATHS)
        new = git("ls-files", "--others", "--exclude-standard", "--", *CODE_PATHS).splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    if not head:
        return None
    added = {}
    for name in sorted(new):
        try:  # a file removed between git's listing and this read (an editor's temporary file) is no change
            added[name] = (root / name).read_bytes()
        except FileNotFoundError:
            continue
    if not diff and not added:
        return head
    changes = hashlib.sha256(diff.encode())
    for name, data in added.items():
        changes.update(name.encode() + b"\0" + data)
    return f"{head}+changes.{changes.hexdigest()[:8]}"


def record_path(metrics_file: Path) -> Path:
    """Where the whole record of the headline file `metrics_file` lives."""
    return metrics_file.parent / RECORDS / metrics_file.name


def metrics_files(metrics_file: Path) -> list[Path]:
    """The two files a stage writes for one metrics file: its headline and its record (for `check_outputs`)."""
    return [metrics_file, record_path(metrics_file)]


def write_record(metrics_file: Path, record: dict[str, Any], headline: dict[str, Any]) -> None:
    """The record, then its headline (each replaced whole): a reader never sees a headline without its record.
    The record names the code that wrote it (`settings.code`, `code_version`): records only, not the
    outputs other stages read (a model's settings, the features manifest), whose hash would change with it."""
    record = {**record, "settings": {**(record.get("settings") or {}), "code": code_version()}}
    write_json(record_path(metrics_file), record)
    write_json(metrics_file, headline)


def read_record(metrics_file: Path) -> dict[str, Any]:
    """The whole record behind a headline file (or the file itself, written before the split)."""
    full = record_path(metrics_file)
    return json.loads((full if full.exists() else metrics_file).read_text())


def read_records(metrics_dir: Path, prefix: str = "") -> dict[str, dict[str, Any]]:
    """{stem: record} of the headline files `metrics_dir/<prefix>*.json`, in name order."""
    return {f.stem: read_record(f) for f in sorted(metrics_dir.glob(f"{prefix}*.json"))}


def rival_names(settings: dict[str, Any] | None) -> list[str]:
    """The rivals (eval.rivals) a run recorded, in the order the config listed them: records are written with sorted
    keys, so each rival carries its place (`order`; records before it: their keys' order)."""
    rivals = (settings or {}).get("rivals") or {}
    return sorted(rivals, key=lambda r: rivals[r].get("order", 0))


def headline_of_evaluation(metrics: dict[str, Any]) -> dict[str, Any]:
    """The run's own draft (the `spec` rows): tau at T=0, the mean over datasets, and the speed-up over AR, the
    geometric mean over datasets and temperatures. Two columns for every evaluate run: per dataset, temperature
    and rival (eval.rivals) they made ~40 columns of `dvc metrics show`; the record and the report keep them."""
    rows = [(temp, cells["spec"]) for temps in metrics["results"].values() for temp, cells in temps.items()
            if "spec" in cells]
    out: dict[str, Any] = {}
    taus = [row["tau"] for temp, row in rows if temp == "T0" and "tau" in row]
    if taus:
        out["tau_t0"] = round(statistics.fmean(taus), 4)
    speedups = [row["speedup"] for _, row in rows if row.get("speedup", 0) > 0]
    if speedups:
        out["speedup"] = round(statistics.geometric_mean(speedups), 4)
    return out


def headline_of_training(result: dict[str, Any]) -> dict[str, Any]:
    """The validation acceptance at T=0 and the simulated tau at T=0 (at T=1 and per position: the record)."""
    f = result["final"]
    keys = {"val/alpha_t0": "alpha_t0", "val/tau_sim_t0": "tau_sim_t0"}
    return {short: round(f[k], 4) for k, short in keys.items() if k in f}


def headline_of_serving(metrics: dict[str, Any]) -> dict[str, Any]:
    """Per concurrency, the speed-up over the engine alone that the deployed schedule served (the K chosen per
    load, speculation off where none paid); the best single K's where no schedule was served."""
    deployed = (metrics.get("deploy") or {}).get("speedup_geomean") or {}
    return {c: deployed.get(c, chosen["speedup_geomean"]) for c, chosen in metrics["chosen_k"].items()}
