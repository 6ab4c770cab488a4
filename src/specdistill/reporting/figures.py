"""PNG figures: acceptance by position, speed-up bars, tau against K predicted from measured acceptance.

Each figure is a grid of panels, one per dataset x temperature, with one series per evaluated run and one legend
beside the grid: a run keeps its colour in every panel, and no legend sits over the data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from specdistill.reporting import alphas, chained_tau, drafted, own_label, settings  # noqa: E402
from specdistill.reporting.tables import FEW_ROUNDS, SHOWN_POSITIONS  # noqa: E402

plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "legend.fontsize": 9})


def finish(fig: Any, ax: Any, out: Path, grid: bool = False, legend: bool = True) -> None:
    """The end every one-panel figure shares: legend, optional grid, tight layout, a 120-dpi PNG, the figure closed."""
    if grid:
        ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def panels(all_metrics: dict[str, dict[str, Any]]) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The (dataset, temperature) panels in a stable order, and a colour per evaluated run kept across panels."""
    keys = sorted({(d, t) for _, d, t, _ in settings(all_metrics)})
    cmap = plt.get_cmap("tab10" if len(all_metrics) <= 10 else "tab20")
    return keys, {name: cmap(i % cmap.N) for i, name in enumerate(sorted(all_metrics))}


def grid(keys: list[tuple[str, str]], width: float = 4.2, height: float = 3.2, sharex: bool = True) -> tuple[Any, dict]:
    """A figure with a panel per (dataset, temperature): datasets in rows, temperatures in columns."""
    datasets, temps = sorted({d for d, _ in keys}), sorted({t for _, t in keys})
    fig, axes = plt.subplots(len(datasets), len(temps), figsize=(width * len(temps) + 2.2, height * len(datasets)),
                             squeeze=False, sharex=sharex, sharey=True)
    by_key = {}
    for i, d in enumerate(datasets):
        for j, t in enumerate(temps):
            ax = axes[i][j]
            ax.set_title(f"{d}, T = {t[1:]}")
            ax.grid(alpha=0.3)
            by_key[(d, t)] = ax
            if (d, t) not in keys:
                ax.set_visible(False)
    return fig, by_key


def legend_beside(fig: Any, axes: dict, out: Path, title: str) -> None:
    """One legend for the grid, to the right of it (the runs are the same in every panel), then the PNG."""
    handles: dict[str, Any] = {}  # label -> its first handle
    for ax in axes.values():
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    fig.suptitle(title)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def alpha_axes(axes: dict) -> None:
    """Axes of acceptance by draft position: 0..1, integer positions, labels on the outer panels."""
    for ax in axes.values():
        ax.set(ylim=(0, 1.05), xlabel="draft position k" if ax.get_subplotspec().is_last_row() else "")
        ax.xaxis.get_major_locator().set_params(integer=True)
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("alpha_k (given 1..k-1 accepted)")


def acceptance_by_position(all_metrics: dict[str, dict[str, Any]], out: Path) -> None:
    keys, colour = panels(all_metrics)
    fig, axes = grid(keys)
    for name, dataset, temp, m in settings(all_metrics):
        a = alphas(m.get("spec", {}))
        if a:
            axes[(dataset, temp)].plot(range(1, len(a) + 1), a, marker="o", color=colour[name], label=name)
    alpha_axes(axes)
    legend_beside(fig, axes, out, "Acceptance by draft position (our decoder)")


def settled_alphas(summary: dict[str, Any], unrecorded: int = SHOWN_POSITIONS) -> list[float]:
    """alpha_1, alpha_2, ... up to the first position reached in fewer than FEW_ROUNDS rounds (one round's 0 or 1
    is no share); where a record predates the counts, the first `unrecorded` (the head-to-head tables' cap)."""
    a = alphas(summary)
    if "attempts_pos1" not in summary:
        return a[:unrecorded]
    n = next((k for k in range(len(a)) if summary.get(f"attempts_pos{k + 1}", 0) < FEW_ROUNDS), len(a))
    return a[:n]


def head_to_head_series(all_metrics: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, list[float]]]:
    """(drafter, dataset, temperature, its settled alpha_k) for every drafter of the runs with rivals (eval.rivals),
    named as the head-to-head tables name them; empty where no run has rivals or none reached a settled position."""
    runs = {n: m for n, m in sorted(all_metrics.items()) if m["settings"].get("rivals")}

    def name_of(run: str, row: str) -> str:
        if row == "spec":
            return own_label(run, runs[run])
        return row if len(runs) == 1 else f"{run}: {row}"
    return [(name_of(run, row), dataset, temp, a)
            for run, metrics in runs.items() for row, *_ in drafted(run, metrics)
            for dataset, temps in metrics["results"].items() for temp, rows in temps.items()
            if (a := settled_alphas(rows.get(row, {})))]


def head_to_head(all_metrics: dict[str, dict[str, Any]], out: Path) -> bool:
    """Acceptance by draft position of every drafter in the runs with rivals, a colour each: the drafters of one run
    side by side on the same prompts. False (nothing written) where there is nothing to draw."""
    series = head_to_head_series(all_metrics)
    if not series:
        return False
    names = list(dict.fromkeys(name for name, *_ in series))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    fig, axes = grid(sorted({(d, t) for _, d, t, _ in series}))
    for name, dataset, temp, a in series:
        axes[(dataset, temp)].plot(range(1, len(a) + 1), a, marker="o", color=cmap(names.index(name) % cmap.N),
                                   label=name)
    alpha_axes(axes)
    legend_beside(fig, axes, out, "Head to head: acceptance by draft position in one run (our decoder)\n"
                  f"positions reached in {FEW_ROUNDS}+ rounds; the first {SHOWN_POSITIONS} where a run did not "
                  "count them")
    return True


def speedup_bars(all_metrics: dict[str, dict[str, Any]], out: Path) -> None:
    """Per panel, a horizontal bar per evaluated run and per rival drafted in it (eval.rivals, "run: rival", hatched
    in the run's colour): its speculative speed-up over AR in the same run, with the 95% interval over prompts; HF
    generate (the library baseline of each run) as a grey tick."""
    keys, colour = panels(all_metrics)
    rows = {name: [(row, name if row == "spec" else f"{name}: {row}") for row, *_ in drafted(name, metrics)]
            for name, metrics in sorted(all_metrics.items())}
    labels = [label for run in rows.values() for _, label in run]
    fig, axes = grid(keys, width=4.6, height=0.42 * len(labels) + 1.4, sharex=False)
    for name, dataset, temp, m in settings(all_metrics):
        ax = axes[(dataset, temp)]
        for row, label in rows[name]:
            s, y = m.get(row), labels.index(label)
            if s and "speedup" in s:
                v = s["speedup"]
                lo, hi = s.get("speedup_ci95") or (v, v)
                # clamped: matplotlib refuses negative error bars (an interval from older metrics can miss its point)
                ax.barh(y, v, xerr=[[max(0.0, v - lo)], [max(0.0, hi - v)]], color=colour[name], capsize=3,
                        hatch="//" if row != "spec" else None, edgecolor="white" if row != "spec" else None)
                ax.text(max(v, hi) + 0.03, y, f"{v:.2f}x", va="center", fontsize=8)
        if "speedup" in m.get("hf_generate", {}):
            y = labels.index(name)
            ax.plot([m["hf_generate"]["speedup"]] * 2, [y - 0.4, y + 0.4], color="dimgray", lw=2,
                    label="HF generate (same run)")
    for ax in axes.values():
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s over our AR loop")
        ax.set_xlim(0, max(2.0, ax.get_xlim()[1] + 0.2))
    legend_beside(fig, axes, out, "Speed-up over AR (same prompts, same process; bars: 95% interval over prompts)")


def tau_vs_k(all_metrics: dict[str, dict[str, Any]], out: Path) -> None:
    """tau(K) = 1 + sum_{k<=K} prod_{i<=k} alpha_i from the measured alpha_k, with the measured tau marked."""
    keys, colour = panels(all_metrics)
    fig, axes = grid(keys)
    for name, dataset, temp, m in settings(all_metrics):
        s = m.get("spec", {})
        a = alphas(s)
        if not a:
            continue
        ax, taus = axes[(dataset, temp)], chained_tau(a)
        ax.plot(range(len(taus)), taus, marker=".", color=colour[name], label=name)
        if "tau" in s:
            ax.scatter([len(a)], [s["tau"]], color=colour[name], marker="x", s=60)
    for ax in axes.values():
        ax.set_xlabel("draft length K" if ax.get_subplotspec().is_last_row() else "")
        ax.xaxis.get_major_locator().set_params(integer=True)
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("tau (tokens per target forward)")
    legend_beside(fig, axes, out, "tau against K chained from the measured alpha_k (x: the measured tau)")
