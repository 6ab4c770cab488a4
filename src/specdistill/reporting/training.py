"""The distillation part of the report: one row per trained draft, one per sweep job, the acceptance curves.

The records of `metrics/train_<name>.json` (train stage) and `metrics/sweep/*.json` (Hydra multirun jobs) hold the final
validation numbers with the settings; `plots/train_<name>/val.csv` the validation passes against step.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from specdistill.core.records import read_records
from specdistill.methods import describe_training, trained_method


def load_training(metrics_dir: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    runs = {name.removeprefix("train_"): r for name, r in read_records(metrics_dir, "train_").items()}
    return runs, read_records(metrics_dir / "sweep")


def load_curves(plots_dir: Path, names: list[str]) -> dict[str, list[dict[str, float]]]:
    curves = {}
    for name in names:
        f = plots_dir / f"train_{name}" / "val.csv"
        if f.exists():
            with open(f) as fh:
                curves[name] = [{k: float(v) for k, v in row.items() if v not in ("", "None")}
                                for row in csv.DictReader(fh)]
    return curves


def _lineage(s: dict[str, Any]) -> str:
    """The runs a continued draft stands on, by name and steps (recorded by the train stage); a record from
    before lineage names the folder only, not the machine's path to it."""
    runs = s.get("lineage")
    if not runs:
        return f"`{Path(s['method']['init_from']).name}`"
    steps = [f"{e['run']} {e['steps']}" if e.get("steps") is not None else e["run"] for e in runs]
    return f"`{runs[-1]['run']}` ({' + '.join(steps)} steps)"


def _row(name: str, r: dict[str, Any]) -> str:
    s, f = r["settings"], r["final"]
    data = s["distill"]["data"]
    vocab = s.get("draft_vocab") or "full"
    student, init = describe_training(s)
    if s["method"].get("init_from"):  # a continued run: its steps are this run's, on top of that folder's;
        how = "continued from" if r["steps"] else "validated as saved in"  # or none: max_steps=0 validates it
        init = f"{how} {_lineage(s)}"
    source = data["source"]
    if s.get("prompt_mix"):  # data.code_fraction: the prompts the answers were generated for
        source += f", {s['prompt_mix']['code_fraction']:.0%} code prompts"
    tau_t1 = f"{f['val/tau_sim']:.2f}" if "val/tau_sim" in f else "–"  # deterministic drafts (Medusa) have no T=1 chain
    return (f"| {name} | {student} | {init} | {vocab} | {s['loss']['name']} | {source} | {r['steps']} | "
            f"{s.get('train_tokens', 0):,} | {f.get('val/alpha', 0):.3f} | {f.get('val/alpha_t0', 0):.3f} | "
            f"{tau_t1} | {f.get('val/tau_sim_t0', 0):.2f} | {s['draft_parameters'] / 1e6:.1f}M |")


HEADER = ["| run | draft | init | draft vocab | loss | training data | steps | train tokens | val/alpha (T=1) | "
          "alpha at T=0 | tau_sim K=4 (T=1) | tau_sim K=4 (T=0) | parameters |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def training_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    return [*HEADER, *(_row(name, r) for name, r in runs.items())]


def sweep_table(sweep: dict[str, dict[str, Any]]) -> list[str]:
    rows = sorted(sweep.items(), key=lambda kv: (trained_method(kv[1]["settings"]),
                                                 (kv[1]["settings"].get("draft") or {}).get("num_layers", 0),
                                                 kv[1]["settings"]["loss"]["name"]))
    return [*HEADER, *(_row(name, r) for name, r in rows)]


def curve_label(name: str, r: dict[str, Any]) -> str:
    """A run's name in the figure; a continued run's steps are its own, so the label says what came before
    (the lineage's steps; a folder saved without settings adds none)."""
    if not r.get("settings", {}).get("method", {}).get("init_from"):
        return name
    lineage = r["settings"].get("lineage")
    if not lineage:  # recorded before lineage
        return f"{name} (continued)"
    return f"{name} (after {sum(e.get('steps') or 0 for e in lineage)} steps)"


def alpha_curves(curves: dict[str, list[dict[str, float]]], path: Path, labels: dict[str, str] | None = None) -> None:
    from specdistill.reporting.figures import finish, plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in curves.items():
        steps, label = [r["step"] for r in rows], (labels or {}).get(name, name)
        ax.plot(steps, [r["alpha"] for r in rows], marker="o", label=f"{label}: alpha (T=1)")
        ax.plot(steps, [r["alpha_t0"] for r in rows], marker="s", linestyle="--", label=f"{label}: alpha at T=0")
    ax.set(xlabel="training step", ylabel="validation acceptance", title="Acceptance curves: val/alpha against step")
    finish(fig, ax, path, grid=True)
