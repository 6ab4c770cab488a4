"""The distillation part of the report: one row per trained draft, one per sweep job, the acceptance curves.

The records of `metrics/train_<name>.json` (train stage) and `metrics/sweep/*.json` (Hydra multirun jobs) hold the final
validation numbers with the settings; `plots/train_<name>/val.csv` the validation passes against step.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from specdistill.methods import describe_training
from specdistill.records import read_records


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
    rows = sorted(sweep.items(), key=lambda kv: (kv[1]["settings"]["method"].get("name", "draft"),
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

def medusa_tables(runs: dict[str, dict[str, Any]], evaluated: dict[str, dict[str, Any]]) -> list[str]:
    """Per-head accuracy, the trees grown from it, and exercises 3 and 4 (docs/definitions.md), from measurement."""
    from specdistill.models.medusa_tree import cartesian_choices, expected_accepted

    lines: list[str] = []
    for name, r in runs.items():
        if "trees" not in r:
            continue
        f, acc, k = r["final"], r["trees"]["acc"], r["settings"]["method"]["num_heads"]
        lines += [f"### Medusa heads (`{name}`): per-head accuracy on the validation data", "",
                  "Head k at position t against the target's top token at t+k (the token k+1 steps ahead); alpha is",
                  "sum min(p, q) at temperature 1 over the full vocabulary.", "",
                  "| head | predicts | top-1 | top-5 | alpha (T=1) |", "|---|---|---|---|---|"]
        lines += [f"| {i} | x(t+{i + 1}) | {f[f'val/head{i}_top1']:.3f} | {f[f'val/head{i}_top5']:.3f} | "
                  f"{f[f'val/head{i}_alpha']:.3f} |" for i in range(1, k + 1)]
        lines += ["", "Trees grown from these accuracies (best-first by path probability, heads taken as independent):",
                  "", "| nodes | depth | candidate sequences (leaves) | expected tau |", "|---|---|---|---|"]
        for b, t in sorted(r["trees"]["trees"].items(), key=lambda kv: int(kv[0])):
            choices = [tuple(c) for c in t["choices"]]
            leaves = sum(1 for c in choices if not any(len(o) == len(c) + 1 and o[:-1] == c for o in choices))
            lines.append(f"| {b} | {max(map(len, choices))} | {leaves} | {t['expected_tau']:.2f} |")
        if k >= 3:
            full = cartesian_choices(3, 3)
            chosen = [tuple(c) for c in min(r["trees"]["trees"].values(), key=lambda t: len(t["choices"]))["choices"]]
            lines += ["", "**Exercise 3** (3 heads, top-3 each): the full cartesian tree has 3^3 = 27 candidate "
                      f"sequences and {len(full)} tree tokens (3 + 9 + 27), for an expected tau of "
                      f"{1 + expected_accepted(full, acc):.2f} under the measured accuracies; the chosen tree spends "
                      f"{len(chosen)} tokens for {1 + expected_accepted(chosen, acc):.2f}."]
        lines += ["", *medusa_memory(r, runs, evaluated), ""]
    return lines


def medusa_memory(medusa: dict[str, Any], runs: dict[str, dict[str, Any]],
                  evaluated: dict[str, dict[str, Any]]) -> list[str]:
    """Exercise 4: the memory of the Medusa heads against the separate draft (parameters; bytes at bf16)."""
    rows = ["**Exercise 4**, memory at bf16 (2 bytes a parameter): what each method adds to the target's 135M.", "",
            "| method | parameters | bytes (bf16) | note |", "|---|---|---|---|"]
    n = medusa["settings"]["draft_parameters"]
    rows.append(f"| Medusa heads | {n / 1e6:.1f}M | {n * 2 / 2**20:.0f} MiB | "
                f"{medusa['settings']['method']['num_heads']} heads, "
                f"vocabulary {medusa['settings'].get('draft_vocab') or 'full'} |")
    for name, r in runs.items():
        if r["settings"]["method"].get("name", "draft") == "draft":
            d = r["settings"]["draft_parameters"]
            rows.append(f"| separate draft `{name}` | {d / 1e6:.1f}M | {d * 2 / 2**20:.0f} MiB | "
                        "includes its own copy of the input embeddings (28M), "
                        "which a deployment could share with the target |")
    return rows


def eagle_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Per-step acceptance of the EAGLE heads unrolled on their own states (validation, full vocabulary)."""
    rows = {n: r for n, r in runs.items() if "variant" in r["settings"]["method"]}
    if not rows:
        return []
    k = max(int(key.removeprefix("val/alpha_pos").removesuffix("_t0")) for r in rows.values()
            for key in r["final"] if key.startswith("val/alpha_pos"))
    head = " | ".join(f"step {i} (T=1 / T=0)" for i in range(1, k + 1))
    lines = ["### EAGLE heads: acceptance per drafting step (validation)", "",
             "Step k's alpha given steps 1..k-1 were accepted, each step fed the head's own state (the chain the",
             "decoder drafts); coverage is the target's probability mass inside the draft vocabulary.", "",
             f"| run | {head} | tau_sim K=4 (T=1 / T=0) | vocabulary coverage |", "|---|" + "---|" * (k + 2)]
    for name, r in rows.items():
        f = r["final"]
        cells = " | ".join(f"{f.get(f'val/alpha_pos{i}', 0):.3f} / {f.get(f'val/alpha_pos{i}_t0', 0):.3f}"
                           for i in range(1, k + 1))
        cov = f.get("val/vocab_coverage")
        lines.append(f"| {name} | {cells} | {f.get('val/tau_sim', 0):.2f} / {f.get('val/tau_sim_t0', 0):.2f} | "
                      f"{'–' if cov is None else f'{cov:.3f}'} |")
    return [*lines, ""]
