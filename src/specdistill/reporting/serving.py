"""The report's "in the engine" section: what vLLM measured serving each draft (serve@<m> stages), and its
acceptance beside our decoder's on the same requests."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from specdistill.core.records import read_records


def load_serving(metrics_dir: Path) -> dict[str, dict[str, Any]]:
    """{method: metrics} of the serve stages (metrics/serve_<m>.json)."""
    return {name.removeprefix("serve_"): m for name, m in read_records(metrics_dir, "serve_").items()}


def _f(x: Any, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def step_cost(row: dict[str, Any]) -> float | None:
    """One speculative step's cost in steps of the engine alone: it yields tau tokens where the engine alone
    yields one, so tokens/s over the engine alone is tau / cost."""
    return row["tau"] / row["speedup"] if row.get("tau") and row.get("speedup") else None


def engine_layout(settings: dict[str, Any]) -> str:
    """Where the engine's core ran (records before `serve.multiprocessing` ran it in its own process)."""
    return ("the engine core in its own process" if settings.get("multiprocessing", True)
            else "the engine core in the worker's process")


def serving_tables(serve: dict[str, dict[str, Any]]) -> list[str]:
    if not serve:
        return []
    any_s = next(iter(serve.values()))["settings"]
    lines = ["## In the engine: vLLM serving each draft", "",
             f"vLLM {any_s.get('vllm')} (its own environment, torch {any_s.get('engine_torch')}), "
             f"{any_s.get('engine_dtype')}, threads bound to {any_s.get('threads')}, Intel OpenMP "
             f"{'preloaded' if any_s.get('iomp') else 'not preloaded'}, "
             f"{engine_layout(any_s)}, on {any_s.get('device')}; "
             f"{any_s.get('num_prompts')} prompts per dataset (first turn), "
             f"max_new_tokens {any_s.get('max_new_tokens')}; "
             "a run at concurrency c sends max(prompts, 2c) requests through a client that keeps c in flight. "
             "Speed-up: output tokens/s over the same engine without speculation on the same requests; "
             "tau = 1 + accepted / drafts from the engine's own counters. K is chosen per concurrency "
             "(best geometric-mean speed-up over datasets and temperatures); where no K beats the engine alone, "
             "the choice is to serve without speculation at that load (\"off\"). Those choices make one schedule "
             "(vLLM's `num_speculative_tokens_per_batch_size`), served once more at every load: the \"deployed\" "
             "column is what a user serving it gets.", ""]
    all_k = sorted({k for m in serve.values() for k in m["settings"].get("k", [])})  # a Medusa export serves fewer
    lines += ["| method | concurrency | K chosen | speed-up (geomean) | deployed | " + " | ".join(
        f"K={k}" for k in all_k) + " |", "|---|---|---|---|---|" + "---|" * len(all_k)]
    for method, m in serve.items():
        ks = m["settings"].get("k", [])
        for c, chosen in sorted(m["chosen_k"].items(), key=lambda kv: int(kv[0][1:])):  # c1, c4, c16
            per_k = []
            for k in all_k:
                xs = [t[c][f"k{k}"]["speedup"] for ds in m["results"].values() for t in ds.values()] if k in ks else []
                per_k.append(f"{statistics.geometric_mean(xs):.2f}x" if xs else "–")
            pick = (f"{chosen['k']} | {chosen['speedup_geomean']:.2f}x" if chosen["speedup_geomean"] >= 1.0 else
                    f"off (best K={chosen['k']}: {chosen['speedup_geomean']:.2f}x) | 1.00x")
            deployed = (m.get("deploy") or {}).get("speedup_geomean", {}).get(c)
            shown = f"{deployed:.2f}x" if deployed is not None else "-"
            lines.append(f"| {method} | {c[1:]} | {pick} | {shown} | " + " | ".join(per_k) + " |")
    for method, m in serve.items():
        spec = (m.get("deploy") or {}).get("speculative_config")
        if spec:
            lines += ["", f"To serve {method} as measured: `vllm serve models/export/target --speculative-config "
                      f"'{json.dumps(spec)}'` (the draft path as exported)."]
    lines += ["", "At the best K, per dataset and temperature. "
              "Step cost: what one speculative step of the engine costs in "
              "steps of the engine alone, tau / speed-up (drafting, the wider verification and the engine's own "
              "bookkeeping together); a speed-up s needs tau >= s x that cost.", "",
              "| method | dataset | T | c | K | tau | alpha_pos1 | tokens/s | engine alone | speed-up | step cost | "
              "p50 latency (s) | alone |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, m in serve.items():
        for ds, temps in m["results"].items():
            for t, cells in temps.items():
                for c, cell in sorted(cells.items(), key=lambda kv: int(kv[0][1:])):
                    k = m["chosen_k"][c]["k"]
                    row, ar = cell[f"k{k}"], cell["ar"]
                    lines.append(f"| {method} | {ds} | {t[1:]} | {c[1:]} | {k} | {_f(row.get('tau'))} | "
                                 f"{_f(row.get('alpha_pos1'))} | {row['tokens_per_s']:.1f} | "
                                 f"{ar['tokens_per_s']:.1f} | "
                                 f"{row['speedup']:.2f}x | {_f(step_cost(row))} | {row['latency_p50_s']:.2f} | "
                                 f"{ar['latency_p50_s']:.2f} |")
    suspect = [(method, cell) for method, m in serve.items() for cell in m.get("above_tau", [])]
    if suspect:
        lines += ["", f"**Check these:** {len(suspect)} run(s) measured a speed-up above their tau, which one engine "
                  "start cannot give (each step costs at least a target forward and yields tau tokens): the engine "
                  "alone was slowed in that start, e.g. by another process. " + ", ".join(
                      f"{method} {cell}" for method, cell in suspect[:8]) + (" ..." if len(suspect) > 8 else "")]
    lines += ["", "Cold start of each engine (s; where `stop_s` is recorded the starts shared one process, and "
              "the first paid vLLM's lazy imports): " + "; ".join(
        f"{method}: " + ", ".join(f"{s} {v:.0f}" for s, v in m.get("cold_start_s", {}).items())
        for method, m in serve.items()), ""]
    lines += agreement_table(serve)
    lines += ["![speed-up in the engine against concurrency](serve_speedup.png)", ""]
    return lines


def agreement_table(serve: dict[str, dict[str, Any]]) -> list[str]:
    rows = [(method, ds, a) for method, m in serve.items() for ds, a in (m.get("agreement") or {}).items()]
    if not rows:
        return []
    lines = ["### The engine's acceptance beside our decoder's", "",
             "The same requests (concurrency 1, T = 0) and the same chain (K drafted per round); both counted as the "
             "engine counts (accepted prefixes per round). alpha_pos{k} is conditional on the earlier positions. "
             "z: the difference in first-position acceptance over its standard error (|z| < 2: within the noise of "
             "the prompt count). For ngram the two lookup rules may take different earlier matches (vLLM: the "
             "longest n-gram's rightmost match; ours: the latest match of the longest n-gram), so there a gap is "
             "a difference of rule, for EAGLE a bug.", "",
             "| method | dataset | K | drafts (engine / ours) | tau (engine / ours) | alpha by position, engine | "
             "ours | z |",
             "|---|---|---|---|---|---|---|---|"]
    for method, ds, a in rows:
        e, o, k = a["engine"], a["ours"], a["k"]
        pos = lambda d, k=k: " / ".join(_f(d.get(f"alpha_pos{i}")) for i in range(1, k + 1))  # noqa: E731
        lines.append(f"| {method} | {ds} | {k} | {e.get('drafts')} / {o.get('drafts')} | {_f(e.get('tau'))} / "
                     f"{_f(o.get('tau'))} | {pos(e)} | {pos(o)} | {_f(a.get('z_pos1'))} |")
    return lines + [""]


def serving_figure(serve: dict[str, dict[str, Any]], path: Path) -> None:
    """Speed-up over the engine alone against concurrency: one panel per method, a line per K and the deployed
    schedule in black (geomean over datasets and temperatures)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(serve), figsize=(4.2 * len(serve), 3.8), dpi=150, sharey=True, squeeze=False)
    for ax, (method, m) in zip(axes[0], serve.items(), strict=True):
        conc = sorted(int(c[1:]) for c in m["chosen_k"])
        for k in m["settings"].get("k", []):
            ys = [statistics.geometric_mean([t[f"c{c}"][f"k{k}"]["speedup"] for ds in m["results"].values()
                                             for t in ds.values()]) for c in conc]
            ax.plot(conc, ys, marker="o", label=f"K={k}")
        deployed = (m.get("deploy") or {}).get("speedup_geomean", {})
        if deployed:
            ax.plot(conc, [deployed.get(f"c{c}", float("nan")) for c in conc], marker="s", lw=2.2, color="black",
                    label="deployed schedule")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
        ax.set_title(f"vLLM with {method}")
        ax.set_xlabel("concurrency (requests in flight)")
        ax.legend(fontsize=8, loc="lower left")
    axes[0][0].set_ylabel("speed-up over the engine alone")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
