"""What the train stage writes beside a draft: the lineage of a continued run and the validation curve."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from specdistill.core.io import atomic_path
from specdistill.core.models.heads_io import read_settings


def lineage(init_from: str) -> list[dict[str, Any]]:
    """The runs a continued draft went through, oldest first: run name, steps, train tokens and prompt mix of
    each, read from the settings saved beside every folder (a folder saved without settings is named only).

    A report can then say what a continued run stands on without the machine's paths."""
    s = read_settings(init_from)
    if not s:
        return [{"run": Path(init_from).name}]
    before = s.get("lineage")
    if before is None:  # saved before lineage was recorded: follow its own init_from (named only once it is gone)
        parent = s.get("method", {}).get("init_from")
        before = lineage(parent) if parent else []
    entry = {"run": s.get("distill", {}).get("output") or Path(init_from).name,
             "steps": s.get("trainer", {}).get("max_steps"), "train_tokens": s.get("train_tokens")}
    if s.get("prompt_mix"):
        entry["prompt_mix"] = s["prompt_mix"]
    return [*before, entry]


def write_curve(rows: list[dict[str, Any]], plots_dir: Path) -> None:
    """val.csv: every validation figure against step (the acceptance curve; Medusa adds its per-head columns)."""
    present = {k for r in rows for k in r}
    keys = ["step"] + [k for k in ("val/alpha", "val/alpha_t0", "val/tau_sim", "val/tau_sim_t0") if k in present]
    keys += sorted(k for k in present if k.startswith(("val/head", "val/tau_tree")))
    with atomic_path(plots_dir, is_dir=True) as tmp:
        with open(tmp / "val.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([k.replace("val/", "") for k in keys])
            for r in rows:
                w.writerow([r.get(k) for k in keys])
