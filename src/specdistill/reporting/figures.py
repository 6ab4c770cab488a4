"""PNG figures: acceptance by position, speed-up bars, tau against K predicted from measured acceptance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from specdistill.reporting import alphas, chained_tau, settings  # noqa: E402


def finish(fig: Any, ax: Any, out: Path, grid: bool = False, legend: bool = True) -> None:
    """The end every figure shares: legend, optional grid, tight layout, a 120-dpi PNG, the figure closed."""
    if grid:
        ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def acceptance_by_position(all_metrics: dict[str, dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, dataset, temp, m in settings(all_metrics):
        a = alphas(m.get("spec", {}))
        if a:
            ax.plot(range(1, len(a) + 1), a, marker="o", label=f"{name} {dataset} {temp}")
    ax.set(xlabel="draft position k", ylabel="alpha_k (accepted | positions < k accepted)", ylim=(0, 1.05),
           title="Acceptance by draft position")
    finish(fig, ax, out)


def speedup_bars(all_metrics: dict[str, dict[str, Any]], out: Path) -> None:
    labels, values, errors = [], [], []
    for name, dataset, temp, m in settings(all_metrics):
        for key in ("hf_generate", "spec", "hf_assisted"):
            if key in m and "speedup" in m[key]:
                labels.append(f"{name}:{key}\n{dataset} {temp}")
                v = m[key]["speedup"]
                values.append(v)
                lo, hi = m[key].get("speedup_ci95") or (v, v)
                # the 95% interval over prompts, where measured; clamped because matplotlib refuses
                # negative error bars (an interval read from older metrics can miss its point)
                errors.append((max(0.0, v - lo), max(0.0, hi - v)))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(values)), 4))
    ax.bar(range(len(values)), values, yerr=list(zip(*errors, strict=True)) if errors else None, capsize=2,
           color=["tab:blue" if ":spec" in lab else "tab:gray" for lab in labels])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=6)
    ax.set(ylabel="tokens/s over our AR loop", title="Speed-up (same prompts, same process)")
    finish(fig, ax, out, legend=False)


def tau_vs_k(all_metrics: dict[str, dict[str, Any]], out: Path) -> None:
    """tau(K) = 1 + sum_{k<=K} prod_{i<=k} alpha_i from the measured alpha_k, with the measured tau marked."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, dataset, temp, m in settings(all_metrics):
        s = m.get("spec", {})
        a = alphas(s)
        if not a:
            continue
        taus = chained_tau(a)
        line, = ax.plot(range(len(taus)), taus, marker=".", label=f"{name} {dataset} {temp}")
        ax.scatter([len(a)], [s["tau"]], color=line.get_color(), marker="x", s=60)
    ax.set(xlabel="draft length K", ylabel="tau (tokens per target forward)",
           title="tau vs K from measured alpha_k (x: measured tau)")
    finish(fig, ax, out)
