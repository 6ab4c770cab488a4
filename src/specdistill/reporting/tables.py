"""Markdown tables: one per dataset and temperature, every method measured in the same run."""

from __future__ import annotations

from typing import Any

from specdistill.core.records import rival_names
from specdistill.evaluation.accounting import expected_accepted_length
from specdistill.methods import describe, find
from specdistill.reporting import (
    alphas,
    branch_of,
    chained_tau,
    companion,
    drafted,
    own_label,
    rival,
    settings,
)

ROW_NAMES = {"ar": "AR (ours, K=0)", "hf_generate": "HF generate", "spec": "speculative (ours)",
             "hf_assisted": "HF assisted (same draft)"}  # then the companions reported beside (eval.beside)


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or v == "":
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def speedup_cell(s: dict[str, Any], interval: bool = True) -> str:
    """The speed-up with its 95% paired interval over prompts where the run measured one
    (not on AR's own row, where it is 1 by construction)."""
    if s.get("speedup") is None:
        return "–"
    ci = s.get("speedup_ci95") if interval else None
    return f"{s['speedup']:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def draft_label(metrics: dict[str, Any]) -> tuple[str, str]:
    """(the run's draft in words, what it was trained with): the method's own words (its registered `describe`),
    then what evaluate added to it (a companion's branch, a depth cap) and its vocabulary."""
    s = metrics["settings"]
    branch = branch_of(s)
    words = describe(metrics)[1] + (f" + {companion(branch, s)[1]}" if branch else "") + depth_cap(s)
    words += f" ({s['draft_vocab']} tokens)" if s.get("draft_vocab") else ""
    trained = s.get("draft_training")
    trains = getattr(find(metrics["method"]), "build", None) is not None  # prompt lookup has nothing to train
    data = f"{trained['loss']} on {trained['data']}" if trained else "untrained" if trains else "–"
    return words, data


def depth_cap(settings: dict[str, Any]) -> str:
    """', depth 2, width 1 (auto)' for a run whose draft was capped (eval.depth, eval.width), chosen for the
    machine or given."""
    auto = settings.get("auto_depth")
    depth, width = (auto["depth"], auto.get("width")) if auto else (settings.get("depth"), settings.get("width"))
    words = "".join(f", {k} {v}" for k, v in (("depth", depth), ("width", width)) if v is not None)
    return words + (" (auto)" if auto else "")


def draft_share(s: dict[str, Any]) -> float | None:
    """The draft's seconds over draft + verification of one speculative row; None where the run timed no draft."""
    return s["draft_s"] / (s["draft_s"] + s["verify_s"]) if "draft_s" in s else None


def time_split(all_metrics: dict[str, dict[str, Any]]) -> list[str]:
    """Seconds in the draft and in target verification per speculative run: where a draft's cost shows."""
    lines = ["| evaluated | setting | draft parameters | draft s | verify s | draft share | tau | "
             "speed-up vs AR (95% CI) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, dataset, temp, m in settings(all_metrics):
        for row, label, record in drafted(name, all_metrics[name]):  # the method's draft, then each rival's
            s = m.get(row, {})
            if (share := draft_share(s)) is None:
                continue
            params = record["settings"].get("draft_parameters")
            lines.append(f"| {label} | {dataset}/{temp} | {f'{params / 1e6:.1f}M' if params else '–'} | "
                         f"{s['draft_s']:.2f} | {s['verify_s']:.2f} | {share:.0%} | "
                         f"{_fmt(s.get('tau'))} | {speedup_cell(s)} |")
    return lines


FEW_ROUNDS = 20  # an acceptance share from fewer rounds than this is shown with its count
SHOWN_POSITIONS = 4  # draft positions the head to head shows (its figure too, where a run did not count rounds)


def alpha_cells(summary: dict[str, Any]) -> list[str]:
    """alpha_k of one summary as table cells, each with its count of rounds where that is small (records from before
    the counts were kept show the share alone)."""
    cells = []
    for k, a in enumerate(alphas(summary), start=1):
        n = summary.get(f"attempts_pos{k}")
        cells.append(f"{a:.2f} (n={n})" if n is not None and n < FEW_ROUNDS else _fmt(a))
    return cells


def head_to_head(all_metrics: dict[str, dict[str, Any]]) -> list[str]:
    """Runs with rivals (eval.rivals): each drafter beside the others, measured in the one run against one AR:
    tau, acceptance by position, the draft's share of decode time and the speed-up with its interval."""
    runs = {n: m for n, m in sorted(all_metrics.items()) if m["settings"].get("rivals")}
    if not runs:
        return []
    counted = all("attempts_pos1" in s for m in runs.values() for temps in m["results"].values()
                  for cells in temps.values() for row, s in cells.items() if row != "ar" and "alpha_pos1" in s)
    rounds = (f"out of n rounds, shown where fewer than {FEW_ROUNDS}: such a share is mostly noise" if counted else
              "the rounds behind each share were not recorded in every run here, so a deep position's share may rest "
              "on a few")
    lines = ["## Head to head: drafters in one run (`eval.rivals`)", "",
             "Each drafter decoded the same prompts in the same process, interleaved, against the same AR rows, so "
             "the figures differ by the drafts, not by the machine's drift between runs. alpha_k: accepted at draft "
             f"position k given 1..k-1 accepted ({rounds}); draft share: the draft's seconds over draft + "
             "verification.", ""]
    for name, metrics in runs.items():
        own = own_label(name, metrics, quote="`")
        rows = [(row, own if row == "spec" else label, record) for row, label, record in drafted(name, metrics)]
        shown = min(SHOWN_POSITIONS, max((len(alphas(m.get(row, {}))) for temps in metrics["results"].values()
                            for m in temps.values() for row, *_ in rows), default=0))
        # each drafter's draft once, then one compact table per dataset and temperature (a row per drafter)
        lines += [f"`{name}`: the drafters", "", "| drafter | draft | trained with |", "|---|---|---|",
                  *(f"| {label} | {' | '.join(draft_label(record))} |" for _, label, record in rows), ""]
        for dataset, temps in metrics["results"].items():
            for temp, m in temps.items():
                lines += [f"| `{name}`, {dataset}/{temp} | tau | "
                          + " | ".join(f"alpha_{k}" for k in range(1, shown + 1))
                          + " | draft share | speed-up vs AR (95% CI) |", "|---|---|" + "---|" * shown + "---|---|"]
                for row, label, _ in rows:
                    s = m.get(row)
                    if not s:
                        continue
                    a, share = alpha_cells(s) + ["–"] * shown, draft_share(s)
                    lines.append(f"| {label} | {_fmt(s.get('tau'))} | " + " | ".join(a[:shown])
                                 + f" | {f'{share:.0%}' if share is not None else '–'} | {speedup_cell(s)} |")
                lines.append("")
    return lines


def results_table(all_metrics: dict[str, dict[str, Any]], dataset: str, temp: str) -> list[str]:
    lines = ["| evaluated | method | draft | loss | alpha_pos1 | tau | tokens/s | speed-up vs AR (95% CI) | "
             "vs HF assisted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, metrics in sorted(all_metrics.items()):
        m = metrics["results"].get(dataset, {}).get(temp)
        if not m:
            continue
        draft, loss = draft_label(metrics)
        rivals = [r for r in rival_names(metrics["settings"]) if r in m]  # in eval.rivals order, as head to head
        for key in [*ROW_NAMES, *rivals, *sorted(set(m) - set(ROW_NAMES) - set(rivals))]:
            if key not in m:
                continue
            s, other = m[key], rival(metrics, key)
            if other:  # a rival: its own draft and training, in this run
                label, (row_draft, row_loss) = f"speculative ({key})", draft_label(other)
            else:
                label = (f"speculative ({name})" if key == "spec" else ROW_NAMES.get(key)
                         or f"{companion(key, metrics['settings'])[1]} (ours)")
                row_draft = draft if key in ("spec", "hf_assisted") else "–"
                row_loss = loss if key == "spec" else "–"
            vs_hf = (_fmt(s.get("speedup_vs_hf_assisted")) + "x" if key == "spec" and "speedup_vs_hf_assisted" in s
                     else "–")
            lines.append(f"| {name} | {label} | {row_draft} | {row_loss} | {_fmt(s.get('alpha_pos1'))} | "
                         f"{_fmt(s.get('tau'))} | {_fmt(s['tokens_per_s'], 1)} | "
                         f"{speedup_cell(s, interval=key != 'ar')} | {vs_hf} |")
    return lines


def formula_check(all_metrics: dict[str, dict[str, Any]]) -> list[str]:
    """Eq. 2 (docs/definitions.md) against measurement: tau predicted from measured alpha vs tau measured."""
    lines = ["| evaluated | setting | K | measured alpha_pos1 | mean alpha over positions | "
             "1 + sum_k prod alpha_i (measured alpha_k) | "
             "1 + sum_k alpha^k (truncated) | 1/(1-alpha) | measured tau |", "|---|---|---|---|---|---|---|---|---|"]
    for name, dataset, temp, m in settings(all_metrics):
        s = m.get("spec", {})
        a = alphas(s)
        if not a or "tau" not in s:
            continue
        k = len(a)
        e = expected_accepted_length(a[0], k)
        lines.append(f"| {name} | {dataset}/{temp} | {k} | {a[0]:.3f} | {sum(a) / k:.3f} | {chained_tau(a)[-1]:.3f} | "
                     f"{e['truncated_sum']:.3f} | {e['geometric_limit']:.3f} | {s['tau']:.3f} |")
    return lines


def tv_check(all_metrics: dict[str, dict[str, Any]]) -> list[str]:
    """Eq. 4: alpha = 1 - TV exactly (sum min(p, q) against the measured first-position acceptance), and
    Pinsker's alpha >= 1 - sqrt(KL/2), at every sampled first draft position."""
    lines = ["| evaluated | setting | drafted positions | measured alpha_pos1 | mean sum min(p, q) = 1 - TV | "
             "mean 1 - sqrt(KL/2) | positions where Pinsker fails |", "|---|---|---|---|---|---|---|"]
    for name, dataset, temp, m in settings(all_metrics):
        s = m.get("spec", {})
        if "alpha_exact_pos1" not in s:
            continue
        lines.append(f"| {name} | {dataset}/{temp} | {s['drafted_positions']} | {_fmt(s.get('alpha_pos1'), 3)} | "
                     f"{s['alpha_exact_pos1']:.3f} | {_fmt(s.get('pinsker_bound_pos1'), 3)} | "
                     f"{s['pinsker_violations']} |")
    return lines


def auto_depth_table(all_metrics: dict[str, dict[str, Any]]) -> list[str]:
    """Runs with eval.depth=auto: the shape chosen from this machine's measured costs, predicted against measured."""
    # (evaluated, the choice, its measured row, the run's results) for each run's draft and each rival's (eval.rivals)
    # chosen so: a rival item's pilot ran inside the run that names it
    chosen = [(label if row == "spec" else f"{name}: {label}", record["settings"]["auto_depth"], row, m["results"])
              for name, m in sorted(all_metrics.items())
              for row, label, record in drafted(name, m)
              if record["settings"].get("auto_depth")]
    if not chosen:
        return []
    lines = ["## Draft shape chosen for the machine (`eval.depth=auto`)", "",
             "Measured at the start of the run (evaluation/autotune.py): the target's verification seconds per node "
             "count and a pilot on dev prompts; predicted speed-up per shape = tau(d, w) x t_verify(0) / "
             "(t_draft(d) + t_verify(nodes(d, w))), for depth d (0 = plain AR) and width w (\"2w1\": depth 2 of "
             "the first children only, a chain; \"2\": depth 2 at the method's own width). Chosen: the best "
             "prediction, or where marked 1-SE the cheapest shape whose gap to it is within one standard error (the "
             "pilot's, paired over its rounds); it was then evaluated on the test prompts.", "",
             "| evaluated | predicted speed-up by shape | chosen | predicted | measured (per setting) | pilot |",
             "|---|---|---|---|---|---|"]
    for name, a, row, results in chosen:
        pred = " / ".join(f"{d}: {p['speedup']:.2f}x" for d, p in a["predicted"].items())
        measured = ", ".join(f"{ds}/{t}: {speedup_cell(s[row], interval=False)}"
                             for ds, temps in results.items() for t, s in temps.items() if row in s)
        choice = a.get("choice", str(a["depth"]))  # records before widths were chosen name the depth only
        rule = " (1-SE)" if a.get("rule") == "one standard error" else ""  # records before the rule: the best
        lines.append(f"| {name} | {pred} | {choice}{rule} | {a['predicted'][choice]['speedup']:.2f}x | "
                     f"{measured} | {a['pilot_rounds']} rounds, {a['seconds']:.0f} s |")
    return lines + [""]
