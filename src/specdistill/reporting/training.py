"""The distillation part of the report: one row per trained draft, one per sweep job, the acceptance curves.

`metrics/train_<name>.json` (train stage) and `metrics/sweep/*.json` (Hydra multirun jobs) hold the final
validation numbers with the settings; `plots/train_<name>/val.csv` the validation passes against step.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any


def load_training(metrics_dir: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    runs = {f.stem.removeprefix("train_"): json.loads(f.read_text()) for f in sorted(metrics_dir.glob("train_*.json"))}
    sweep = {f.stem: json.loads(f.read_text()) for f in sorted((metrics_dir / "sweep").glob("*.json"))}
    return runs, sweep


def load_curves(plots_dir: Path, names: list[str]) -> dict[str, list[dict[str, float]]]:
    curves = {}
    for name in names:
        f = plots_dir / f"train_{name}" / "val.csv"
        if f.exists():
            with open(f) as fh:
                curves[name] = [{k: float(v) for k, v in row.items() if v not in ("", "None")} for row in csv.DictReader(fh)]
    return curves


def _row(name: str, r: dict[str, Any]) -> str:
    s, f = r["settings"], r["final"]
    data = s["distill"]["data"]
    vocab = s.get("draft_vocab") or "full"
    return (f"| {name} | {s['draft']['name']} ({s['draft']['num_layers']} layer{'s' if s['draft']['num_layers'] > 1 else ''}) | "
            f"{s['method']['init']} | {vocab} | {s['loss']['name']} | {data['source']} | {r['steps']} | "
            f"{s.get('train_tokens', 0):,} | {f.get('val/alpha', 0):.3f} | {f.get('val/alpha_t0', 0):.3f} | "
            f"{f.get('val/tau_sim', 0):.2f} | {f.get('val/tau_sim_t0', 0):.2f} | {s['draft_parameters'] / 1e6:.1f}M |")


HEADER = ["| run | draft | init | draft vocab | loss | training data | steps | train tokens | val/alpha (T=1) | "
          "alpha at T=0 | tau_sim K=4 (T=1) | tau_sim K=4 (T=0) | parameters |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def training_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    return [*HEADER, *(_row(name, r) for name, r in runs.items())]


def sweep_table(sweep: dict[str, dict[str, Any]]) -> list[str]:
    rows = sorted(sweep.items(), key=lambda kv: (kv[1]["settings"]["draft"]["num_layers"], kv[1]["settings"]["loss"]["name"]))
    return [*HEADER, *(_row(name, r) for name, r in rows)]


def alpha_curves(curves: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in curves.items():
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["alpha"] for r in rows], marker="o", label=f"{name}: alpha (T=1)")
        ax.plot(steps, [r["alpha_t0"] for r in rows], marker="s", linestyle="--", label=f"{name}: alpha at T=0")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation acceptance")
    ax.set_title("Acceptance curves: val/alpha against step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
