"""The online-distillation part of the report: frozen vs online acceptance, the curve, the update cost."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from specdistill.core.records import read_record


def load_online(metrics_dir: Path, plots_dir: Path) -> dict[str, tuple[dict[str, Any], list[dict[str, float]]]]:
    out = {}
    for f in sorted(metrics_dir.glob("online_*.json")):
        curve = plots_dir / f.stem / "curve.csv"
        rows = []
        if curve.exists():
            with open(curve) as fh:
                rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(fh)]
        out[f.stem] = (read_record(f), rows)
    return out


def online_tables(runs: dict[str, tuple[dict[str, Any], list[dict[str, float]]]]) -> list[str]:
    if not runs:
        return []
    lines = ["## Online speculative distillation", "",
             "The offline draft serves a stream of requests and keeps distilling on the positions where its",
             "tokens were rejected (the target's distribution there comes from the verification it already ran);",
             "the same stream is served by the frozen draft. Held out: the next requests, served by the draft as",
             "it stood after the stream and by the frozen draft. Acceptance rate = accepted / judged draft tokens.", "",
             "| run | scenario | part | requests | frozen acceptance | online acceptance | gain | frozen tau | "
             "online tau |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, (m, _) in runs.items():
        for part in ("stream", "held_out"):
            p = m[part]
            lines.append(f"| {name} | {m['scenario']} | {part.replace('_', ' ')} | {p['online']['requests']} | "
                         f"{p['frozen']['acceptance_rate']:.3f} | {p['online']['acceptance_rate']:.3f} | "
                         f"{p['gain']:+.3f} | {p['frozen']['tau']:.2f} | {p['online']['tau']:.2f} |")
    lines += ["", "| run | updates | rolled back by the gate | stopped after | update s | serving s | update share |",
              "|---|---|---|---|---|---|---|"]
    for name, (m, _) in runs.items():
        t = m["time"]
        rolled = sum(not u.get("deployed", True) for u in m["updates"]) if m.get("settings", {}).get("gate") else "–"
        lines.append(f"| {name} | {len(m['updates'])} | {rolled} | {m['stopped_at'] or '–'} | {t['update_s']:.1f} | "
                     f"{t['serve_s']:.1f} | {t['update_share']:.1%} |")
    return [*lines, *engine_table(runs), "", "![online acceptance](online_curves.png)", ""]


def engine_table(runs: dict[str, tuple[dict[str, Any], list[dict[str, float]]]]) -> list[str]:
    """online_engine@<m>: the same stream served by vLLM while the draft learns in the running engine, beside our
    decoder's run of the same method (online@<m>)."""
    engine = {name: m for name, (m, _) in runs.items() if "engine" in m}
    if not engine:
        return []
    lines = ["", "### Inside the engine", "",
             "vLLM serves the stream (one engine start, no restart); the trainer, in its own process, learns from",
             "the engine's own verdicts and the target's log-probs, and each new version is loaded into the running",
             "engine between two of its steps. Held-out gain beside our decoder's run of the same draft and stream;",
             "the engine's output tokens/s while an update ran against the rest of the stream.", "",
             "| run | held-out gain | our decoder's gain | versions loaded | load ms | tokens/s outside updates | "
             "during updates | T=0 answers as the frozen run's |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in engine.items():
        e, ours = m["engine"], runs.get(name.replace("online_engine_", "online_"))
        ours_gain = f"{ours[0]['held_out']['gain']:+.3f}" if ours else "–"
        loads = e["load_s"] / e["versions_loaded"] * 1000 if e["versions_loaded"] else 0.0
        same = e["identical_to_frozen"]
        lines.append(f"| {name} | {m['held_out']['gain']:+.3f} | {ours_gain} | {e['versions_loaded']} | {loads:.0f} | "
                     f"{e['tokens_per_s_outside'] or '–'} | {e['tokens_per_s_during_updates'] or '–'} | "
                     f"{same['identical']}/{same['requests']} |")
    return lines


def online_curves(runs: dict[str, tuple[dict[str, Any], list[dict[str, float]]]], path: Path) -> None:
    from specdistill.reporting.figures import finish, plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (m, rows) in runs.items():
        x = [r["request"] for r in rows]
        line, = ax.plot(x, [r["online_window"] for r in rows], label=f"{name}: online")
        ax.plot(x, [r["frozen_window"] for r in rows], linestyle="--", color=line.get_color(), label=f"{name}: frozen")
        ax.axvline(m["stream"]["online"]["requests"] - 0.5, color="grey", linewidth=0.8)
    window = runs[next(iter(runs))][0]["settings"].get("window", "?")
    ax.set(xlabel="request (stream, then held out)", ylabel=f"acceptance rate (moving window of {window})",
           title="Online distillation: acceptance against request")
    finish(fig, ax, path, grid=True)
