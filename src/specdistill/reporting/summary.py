"""The report's first table: one row per method, its best evaluated setting, every dataset and temperature side by
side; and the engine's deployed speed-up per method beside it. The detail tables below it list every run."""

from __future__ import annotations

import statistics
from typing import Any

from specdistill.methods import describe
from specdistill.reporting import branch_of, companion, drafted
from specdistill.reporting.tables import draft_label, speedup_cell


def family(metrics: dict[str, Any]) -> str:
    """What a user picks between: the method (and variant, trained or not, as it describes itself) and the
    companion verified as a branch of its tree."""
    branch = branch_of(metrics["settings"])
    return describe(metrics)[0] + (f" + {companion(branch, {})[0]} branch" if branch else "")


def geomean_speedup(metrics: dict[str, Any]) -> float:
    """The geometric mean of a run's speculative speed-ups over every dataset and temperature it measured."""
    xs = [m["spec"]["speedup"] for temps in metrics["results"].values() for m in temps.values()
          if m.get("spec", {}).get("speedup")]
    return statistics.geometric_mean(xs) if xs else 0.0


def candidates(all_metrics: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{label: a record of one draft's rows} for each evaluated run's own draft and each of its rivals' (eval.rivals):
    a rival is a setting of its method as much as a run of its own is, so `compare`'s EAGLE-3.1 and DFlash rows
    reach the summary where no evaluate@<method> ran (the cpu_full experiment runs compare alone)."""
    out = {}
    for name, m in sorted(all_metrics.items()):
        for row, label, record in drafted(name, m):
            results = {d: {t: {"spec": rows[row]} for t, rows in temps.items() if row in rows}
                       for d, temps in m["results"].items()}
            out[name if row == "spec" else f"{name}: {label}"] = {**record, "results": results}
    return out


def best_per_method(all_metrics: dict[str, dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """{family: (label, record)} of the draft with the best geomean speed-up: the one setting a user would deploy."""
    best: dict[str, tuple[str, dict[str, Any]]] = {}
    for label, m in candidates(all_metrics).items():
        f = family(m)
        if f not in best or geomean_speedup(m) > geomean_speedup(best[f][1]):
            best[f] = (label, m)
    return dict(sorted(best.items(), key=lambda kv: -geomean_speedup(kv[1][1])))


def summary_table(all_metrics: dict[str, dict[str, Any]]) -> list[str]:
    cols = sorted({(d, t) for m in all_metrics.values() for d, temps in m["results"].items() for t in temps})
    lines = ["## Summary: the best setting of each method", "",
             "One row per method: of its evaluated settings (a run's own draft or a rival's in a head to head), the",
             "one with the best geometric-mean speed-up over the datasets and temperatures. Each cell: tau (tokens",
             "per target forward) and the speed-up over AR in the same run, with its 95% interval over prompts. Every",
             "run is in the tables below.", "",
             "| method | setting (run) | " + " | ".join(f"{d}, T={t[1:]}" for d, t in cols) + " | geomean speed-up |",
             "|---|---|" + "---|" * (len(cols) + 1)]
    for fam, (label, m) in best_per_method(all_metrics).items():
        cells = []
        for d, t in cols:
            s = m["results"].get(d, {}).get(t, {}).get("spec")
            cells.append(f"tau {s['tau']:.2f}, {speedup_cell(s)}" if s and "tau" in s else "–")
        lines.append(f"| {fam} | {draft_label(m)[0]} (`{label}`) | " + " | ".join(cells) +
                     f" | {geomean_speedup(m):.2f}x |")
    return lines


def engine_summary(serve: dict[str, dict[str, Any]]) -> list[str]:
    """Per method and load, the speed-up over the engine alone: the deployed schedule's where one was served,
    else the best single K's (no K reached the deployment threshold, so a user would serve without it)."""
    if not serve:
        return []
    conc = sorted({c for m in serve.values() for c in m["chosen_k"]}, key=lambda c: int(c[1:]))
    lines = ["", "In the engine (vLLM; the geomean speed-up over the engine alone; details in \"In the engine\"):", "",
             "| method | " + " | ".join(f"concurrency {c[1:]}" for c in conc) + " |", "|---|" + "---|" * len(conc)]
    for method, m in serve.items():
        deployed = (m.get("deploy") or {}).get("speedup_geomean") or {}
        cells = [f"{deployed[c]:.2f}x deployed" if c in deployed else
                 f"{m['chosen_k'][c]['speedup_geomean']:.2f}x at K={m['chosen_k'][c]['k']} (none deployed)"
                 if c in m["chosen_k"] else "–" for c in conc]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines
