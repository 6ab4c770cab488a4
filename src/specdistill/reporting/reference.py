"""The report's "Against the reference trainer" section: speculators' own trainer (reference@<key>) beside ours
(train@<m>) on the same data and steps, judged by the engine (serve@ref_<key> beside serve@<m>) and by our decoder
(evaluate@ref_<key> beside evaluate@<m>). Every figure is read from those stages' records."""

from __future__ import annotations

import json
import math
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


COSMETIC = ("enable_progress_bar", "log_every_n_steps", "val_check_interval", "enable_model_summary")


def curve_of(run: dict[str, Any]) -> str:
    """What a train record's draft is apart from how much data it saw: the items of one data curve share it (the
    method and its size, loss, trainer and distill settings, the target, the validation tokens; not the fraction
    of the training answers, nor how often it logged)."""
    s = run.get("settings") or {}
    distill = json.loads(json.dumps(s.get("distill") or {}))
    (distill.get("data") or {}).pop("train_fraction", None)
    trainer = {k: v for k, v in (s.get("trainer") or {}).items() if k not in COSMETIC}
    return json.dumps([s.get(k) for k in ("method", "draft", "loss", "target_fingerprint", "val_tokens")]
                      + [distill, trainer], sort_keys=True)


def log_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(a, b) of tau = a + b ln(tokens), least squares; None under two distinct sizes."""
    xs, ys = [math.log(x) for x, _ in points], [y for _, y in points]
    if len(set(xs)) < 2:
        return None
    b, a = statistics.linear_regression(xs, ys)
    return a, b


FAR = math.log(1e15)  # a fit that needs more tokens than this for a tau is flat, not a prediction


def tokens_for(fit: tuple[float, float] | None, tau: float) -> float | None:
    """The training tokens the fit predicts for `tau` (None: no fit, tau does not grow with the data, or it grows
    so slowly that the answer is beyond 1e15 tokens)."""
    if fit is None or fit[1] <= 0 or (tau - fit[0]) / fit[1] > FAR:
        return None
    return math.exp((tau - fit[0]) / fit[1])


def data_curve(reference: dict[str, dict[str, Any]], runs: dict[str, dict[str, Any]],
               serve: dict[str, dict[str, Any]]) -> list[str]:
    """Engine tau at T=0 against the training answers' tokens, per trainer, for drafts that differ only in
    distill.data.train_fraction (methods variants, e.g. cpu_full's eagle_d25 / eagle_d50 beside eagle), with the
    fit tau = a + b ln(tokens) and the tokens it predicts for tau 2.5 and 3."""
    t0 = temperature_key([*serve.values()], 0.0)
    if t0 is None:
        return []
    groups: dict[str, list[str]] = {}
    for key, r in runs.items():
        if (r.get("settings") or {}).get("train_tokens"):
            groups.setdefault(curve_of(r), []).append(key)
    lines: list[str] = []
    for keys in groups.values():
        fractions = {runs[k]["settings"]["distill"]["data"].get("train_fraction", 1.0) for k in keys}
        if len(fractions) < 2:
            continue
        trainers: dict[str, list[tuple[float, float, str]]] = {}
        for k in keys:
            tokens = float(runs[k]["settings"]["train_tokens"])
            served = [("ours", k)] + [(f"speculators, {r['recipe']}", f"ref_{ref}") for ref, r in reference.items()
                                      if r["settings"]["methods_key"] == k]
            for label, serve_key in served:
                e = engine_pooled(serve.get(serve_key), t0)
                if e:
                    trainers.setdefault(label, []).append((tokens, e["tau"], serve_key))
        if not trainers:
            continue
        largest = max(keys, key=lambda k: runs[k]["settings"]["train_tokens"])
        lines += [f"## How much data: {largest} and its smaller sizes, the engine's tau against the training answers",
                  "",
                  "The same draft, steps and recipe on the first fraction of the training answers "
                  "(`methods.<m>.data.train_fraction`): the engine's tau at T=0 (as above) against the tokens of "
                  "the answers trained on, and the fit tau = a + b ln(tokens) over them. The tokens it predicts for a "
                  "tau beyond the largest size measured are an extrapolation of that fit, not a measurement.", "",
                  "| trainer | tau T=0 at tokens (item) | a | b | tokens for tau 2.5 | tokens for tau 3 |",
                  "|---|---|---|---|---|---|"]
        for label, pts in trainers.items():
            pts.sort()
            fit = log_fit([(x, y) for x, y, _ in pts])
            at = ", ".join(f"{y:.2f} at {x:,.0f} ({k})" for x, y, k in pts)
            need = [tokens_for(fit, t) for t in (2.5, 3.0)]
            lines.append(f"| {label} | {at} | {_f(fit and fit[0])} | {_f(fit and fit[1], 3)} | "
                         + " | ".join("–" if n is None else f"{n:,.0f}" for n in need) + " |")
        lines += ["", "A dash for a tau: the fit does not rise with the data, or it needs more than 1e15 tokens.", ""]
    return lines
