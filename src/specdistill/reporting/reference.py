"""The report's "Against the reference trainer" section: speculators' own trainer (reference@<key>) beside ours
(train@<m>) on the same data and steps, judged by the engine (serve@ref_<key> beside serve@<m>) and by our decoder
(evaluate@ref_<key> beside evaluate@<m>). Every figure is read from those stages' records."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from specdistill.core.records import read_records
from specdistill.evaluation.accounting import two_proportion_z
from specdistill.reporting.serving import _f


def load_reference(metrics_dir: Path) -> dict[str, dict[str, Any]]:
    """{item: record} of the reference stages (metrics/reference_<key>.json)."""
    return {name.removeprefix("reference_"): r for name, r in read_records(metrics_dir, "reference_").items()}


def engine_pooled(serve: dict[str, Any] | None, temperature: str) -> dict[str, Any] | None:
    """The engine's counters at the agreement chain (K = agreement_k, the lowest concurrency) and temperature, summed
    over the datasets: drafts, accepted per position, alpha_pos{k} (conditional) and tau."""
    if not serve:
        return None
    s = serve["settings"]
    k, c = s.get("agreement_k"), f"c{min(s.get('concurrency') or [1])}"
    drafts, accepted = 0, [0] * (k or 0)
    for temps in serve["results"].values():
        row = ((temps.get(temperature) or {}).get(c) or {}).get(f"k{k}")
        if not row or "accepted_per_pos" not in row:
            continue
        drafts += row["drafts"]
        accepted = [a + b for a, b in zip(accepted, row["accepted_per_pos"], strict=True)]
    if not drafts:
        return None
    before = [drafts, *accepted[:-1]]
    return {"k": k, "drafts": drafts, "accepted_per_pos": accepted, "tau": 1 + sum(accepted) / drafts,
            **{f"alpha_pos{i + 1}": (a / b if b else None) for i, (a, b) in enumerate(zip(accepted, before,
                                                                                            strict=True))}}


def decoder_mean(evaluated: dict[str, Any] | None, temperature: str, key: str) -> float | None:
    """Our decoder's tau or speed-up at a temperature, the mean over the datasets."""
    if not evaluated:
        return None
    xs = [t[temperature]["spec"][key] for t in evaluated["results"].values()
          if temperature in t and t[temperature]["spec"].get(key) is not None]
    return statistics.fmean(xs) if xs else None


def temperature_key(records: list[dict[str, Any] | None], value: float) -> str | None:
    """How the records spell a temperature (T0.0 in serve, T0 in evaluate records)."""
    for r in records:
        for temps in (r or {}).get("results", {}).values():
            for t in temps:
                if float(t[1:]) == value:
                    return t
    return None


def reference_tables(reference: dict[str, dict[str, Any]], runs: dict[str, dict[str, Any]],
                     evaluated: dict[str, dict[str, Any]], serve: dict[str, dict[str, Any]]) -> list[str]:
    if not reference:
        return []
    any_r = next(iter(reference.values()))["settings"]
    lines = ["## Against the reference trainer: vLLM speculators on the same data", "",
             f"speculators {any_r.get('speculators')} (vLLM's trainer, unedited, in the engine's environment with "
             f"torch {any_r.get('engine_torch')}; its CPU shims: src/specdistill/reference/shims.py) trained each "
             "draft below on our training rows and target states (the features store), our draft vocabulary, seed "
             "and optimizer steps, packing about our tokens per step (stage reference). Recipe *matched*: our head's "
             "architecture, loss, AdamW, learning rate and warm-up cosine schedule; *shipped*: speculators' "
             "defaults (Muon, its norms and loss) at the same steps. What stays apart: its teacher is the target's "
             "full distribution from the stored last-layer state, ours the stored top-k; its steps pack sequences "
             "into one row, ours pad a batch.", "",
             "Training on this CPU (the steps only: seconds from each batch's start to its optimizer step; "
             "validation and checkpoints apart; peak resident memory of the training process, ours holding the "
             "target for its live validation):", "",
             "| draft | trainer | steps | tokens | train s | tokens/s | peak MiB |", "|---|---|---|---|---|---|---|"]
    by_method: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for key, r in reference.items():
        by_method.setdefault(r["settings"]["methods_key"], []).append((key, r))
    for m, items in by_method.items():
        ours = (runs.get(m) or {}).get("run") or {}
        lines.append(f"| {m} | ours | {ours.get('steps', '–')} | {ours.get('tokens', '–')} | "
                     f"{_f(ours.get('train_s'), 1)} | {_f(ours.get('tokens_per_s'), 0)} | "
                     f"{_f(ours.get('peak_rss_mib'), 0)} |")
        for _, r in items:
            run = r["run"]
            lines.append(f"| {m} | speculators, {r['recipe']} | {run['steps']} | {run['tokens']} | "
                         f"{_f(run.get('train_s'), 1)} | {_f(run.get('tokens_per_s'), 0)} | "
                         f"{_f(run.get('peak_rss_mib'), 0)} |")
    engines = [*serve.values()]
    t0, t1 = temperature_key(engines, 0.0), temperature_key(engines, 1.0)
    e0, e1 = (temperature_key(list(evaluated.values()), v) for v in (0.0, 1.0))
    lines += ["", "Judged by the engine (vLLM serving each checkpoint beside the exported target: its own counters "
              "at the agreement chain, K = serve.agreement_k, concurrency 1, summed over the datasets) and by our "
              "lossless decoder (evaluate: tau and speed-up over AR, the mean over the datasets). z: the first "
              "position's difference from ours in the engine over its standard error (|z| < 2: within the noise).",
              "", "| draft | trainer | engine alpha by position, T=0 | engine tau T=0 | T=1 | z | our decoder's "
              "tau T=0 | speed-up T=0 |", "|---|---|---|---|---|---|---|---|"]
    for m, items in by_method.items():
        mine = engine_pooled(serve.get(m), t0) if t0 else None
        for label, serve_key, eval_key in [("ours", m, m), *((f"speculators, {r['recipe']}", f"ref_{key}",
                                                               f"ref_{key}") for key, r in items)]:
            e = engine_pooled(serve.get(serve_key), t0) if t0 else None
            e_1 = engine_pooled(serve.get(serve_key), t1) if t1 else None
            z = two_proportion_z(e, mine) if e and mine and label != "ours" else None
            pos = " / ".join(_f(e.get(f"alpha_pos{i}")) for i in range(1, e["k"] + 1)) if e else "–"
            ev = evaluated.get(eval_key)
            lines.append(f"| {m} | {label} | {pos} | {_f(e and e['tau'])} | {_f(e_1 and e_1['tau'])} | {_f(z)} | "
                         f"{_f(decoder_mean(ev, e0, 'tau') if e0 else None)} | "
                         f"{_f(decoder_mean(ev, e0, 'speedup') if e0 else None)} |")
    return lines + ["", "A dash: that stage has not run (`dvc repro serve@ref_<key> evaluate@ref_<key>`), or the "
                    "checkpoint has a layout our decoder does not read (the shipped recipe's norms).", ""]
