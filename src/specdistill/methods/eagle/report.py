"""EAGLE's table in the report's distillation section: acceptance per drafting step of every EAGLE head trained."""

from __future__ import annotations

from typing import Any


def training_tables(runs: dict[str, dict[str, Any]], evaluated: dict[str, dict[str, Any]]) -> list[str]:
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
