"""report: every metrics file into reports/<experiment>/README.md, with PNG figures beside it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specdistill import methods
from specdistill.core.io import atomic_path
from specdistill.core.records import read_record
from specdistill.core.stage import check_outputs
from specdistill.core.tracking import wandb_run
from specdistill.evaluation.contention import busy_lines
from specdistill.reporting import figures, settings
from specdistill.reporting.online import load_online, online_curves, online_tables
from specdistill.reporting.reference import data_curve, load_reference, reference_tables
from specdistill.reporting.series import write_series
from specdistill.reporting.serving import load_serving, serving_figure, serving_tables
from specdistill.reporting.summary import engine_summary, summary_table
from specdistill.reporting.tables import (
    auto_depth_table,
    formula_check,
    head_to_head,
    results_table,
    time_split,
    tv_check,
)
from specdistill.reporting.training import (
    alpha_curves,
    curve_label,
    load_curves,
    load_training,
    sweep_table,
    training_table,
)

log = logging.getLogger(__name__)


def load_metrics(folder: Path) -> dict[str, dict[str, Any]]:
    """The evaluate stages' metrics: the files with `results` (train_*.json and online_*.json are read by
    reporting.training / .online; generate.json holds the generate stage's timing)."""
    files = [f for f in sorted(folder.glob("*.json"))
             if not f.stem.startswith(("train_", "online_", "serve_", "reference_"))]
    found = {f.stem: m for f in files if "results" in (m := read_record(f))}
    if not found:
        raise FileNotFoundError(f"no metrics in {folder}: run the evaluate stages first (`dvc repro`)")
    return found


def log_figures(run_: Any, folder: Path) -> None:
    """The report's PNGs as W&B images (a run with logging off has no directory and logs nothing)."""
    if run_.dir is None:
        return
    import wandb

    run_.log({f"report/{png.stem}": wandb.Image(str(png)) for png in sorted(folder.glob("*.png"))})


def render_training(runs: dict[str, Any], sweep: dict[str, Any], curves: dict[str, Any],
                    evaluated: dict[str, Any] | None = None) -> list[str]:
    if not runs and not sweep:
        return []
    lines = ["## Distillation: validation acceptance of the trained drafts", "",
             "Measured by the train stages on the validation split's on-policy answers (the same tokens for every",
             "run): alpha = mean over response tokens of sum min(p, q) over the full vocabulary (a reduced draft",
             "vocabulary counts the mass it cannot propose as lost); at T=0, whether the argmaxes agree; tau_sim",
             "chains the position-wise acceptance along the target's continuation for a K = 4 chain. For Medusa,",
             "alpha is head 1's (the first drafted token) and tau_sim at T=0 chains the heads' top-1 accuracies.", "",
             *training_table(runs), ""]
    if curves:
        lines += ["![acceptance curves](alpha_curves.png)", ""]
    lines += methods.training_tables(runs, evaluated or {})  # each method's own (Medusa's trees, EAGLE's steps)
    if sweep:
        lines += ["### Sweep: draft size x loss (`python pipelines/train.py -m draft=... loss=...`)", "",
                  *sweep_table(sweep), ""]
    return lines


def machine(settings: dict[str, Any]) -> str:
    """The device a run names, with the CPU's vector capability and bf16 kernels where it recorded them."""
    cpu = settings.get("cpu")
    if not cpu:  # written before the CPU kind was recorded, or a GPU run
        return str(settings.get("device"))
    units = f", {cpu['matrix_units']}" if cpu.get("matrix_units") else ""
    return (f"{settings.get('device')} ({cpu.get('capability')}{units}, "
            f"bf16 {'native' if cpu.get('native_bf16') else 'emulated'})")


def provenance(records: Iterable[dict[str, Any]]) -> list[str]:
    """The code version and the machine behind every record the report reads (each record names both; this is
    the one place the report names them), or which ones differ: a figure is its own code's, and a speed-up compares
    only with one measured on the same kind of CPU. Records from before the code was recorded name none: alone they
    name no code, beside named ones they are a mix."""
    settings = [r.get("settings") or {} for r in records]
    codes = sorted({s["code"] for s in settings if s.get("code")})
    unnamed = sum(not s.get("code") for s in settings)
    machines = sorted({machine(s) for s in settings if s.get("device")})
    same = ([f"code {codes[0]}"] if len(codes) == 1 and not unnamed else []) + \
        ([f"on {machines[0]}"] if len(machines) == 1 else [])
    lines = [f"Every record here: {', '.join(same)}.", ""] if same else []
    if len(codes) > 1 or codes and unnamed:
        named = codes + ([f"{unnamed} record{'s' * (unnamed > 1)} naming none"] if unnamed else [])
        lines += [f"**Measured by more than one code version** ({', '.join(named)}): `dvc repro` reruns only the "
                  "items whose own code changed, so the figures of one version need `dvc repro -f`.", ""]
    if len(machines) > 1:  # each speed-up is against AR in its own run, but the kind of CPU sets its size
        lines += [f"Measured on more than one machine ({'; '.join(machines)}): each speed-up is against AR in "
                  "its own run, but compare speed-ups across runs only on the same kind of machine.", ""]
    return lines


def prompt_counts(prompts: Any) -> str:
    """'4 humaneval + 4 mtbench prompts' from a run's {dataset: count}; a record's other forms as they are."""
    if isinstance(prompts, dict):
        return " + ".join(f"{n} {d}" for d, n in sorted(prompts.items())) + " prompts"
    return f"{prompts} prompts per dataset"


def render(all_metrics: dict[str, dict[str, Any]], experiment: str, training: list[str] | None = None,
           online: list[str] | None = None, serving: list[str] | None = None,
           serve: dict[str, dict[str, Any]] | None = None, head_to_head_png: bool = False,
           reference: list[str] | None = None, provenance_of: Iterable[dict[str, Any]] = ()) -> str:
    any_m = next(iter(all_metrics.values()))
    s = any_m["settings"]
    # metrics without a split were written before the stratified order: each set's first rows
    order = ("each set's categories in turn" if all("split" in m["settings"] for m in all_metrics.values()) else
             "some runs predate the stratified order and took each set's first prompts, MT-bench's all writing")
    lines = [f"# Results: experiment `{experiment}`", "",
             "Written by the `report` stage from the metrics files the train and evaluate stages wrote (`dvc repro`); "
             "no number in it is typed by hand.",
             f"Target {s.get('target_fingerprint', '?')[:23]}…, {s.get('dtype')}, torch {s.get('torch')}, "
             f"transformers {s.get('transformers')}, {s.get('threads')} threads; "
             f"{prompt_counts(s.get('prompts'))} ({order}), max_new_tokens {s.get('max_new_tokens')}; each run's "
             "draft is named in its rows.", "",
             "Speed-up is tokens/s over our AR loop on the same prompts in the same process (methods interleaved);",
             "at temperature 0 every method emits the target's greedy chain, but in bfloat16 a verification "
             "forward over",
             "several positions rounds differently from a one-token step, so where the top two logits tie to within",
             "rounding the outputs part (`benchmarks/greedy_ties.py`: every divergence sits on such a tie, and in",
             "float32 none happens); tokens/s, not wall time, is therefore the ratio.", "",
             *summary_table(all_metrics), *engine_summary(serve or {}), "", *head_to_head(all_metrics)]
    if head_to_head_png:  # figures.head_to_head drew it
        lines += ["![head to head: acceptance by position](head_to_head.png)", ""]
    # the machine and code of every record, the train, online and reference runs' (provenance_of) too
    lines += provenance([*all_metrics.values(), *(serve or {}).values(), *provenance_of])
    # evaluate runs and the engine stages (whose speed-ups the summary above shows too)
    lines += busy_lines({**{n: m["settings"].get("others_cpu_share") for n, m in all_metrics.items()},
                         **{f"serve@{n}": m["settings"].get("others_cpu_share") for n, m in (serve or {}).items()}})
    dev = sorted(n for n, m in all_metrics.items() if m["settings"].get("split", "test") != "test")
    if dev and len(dev) < len(all_metrics):  # tuned-on prompts beside reported ones would not compare
        lines += [f"**Not comparable: {', '.join(dev)} ran on the dev prompts (`eval.split=dev`), the others on the "
                  "test prompts.**", ""]
    elif dev:
        lines += ["**Every run here used the dev prompts (`eval.split=dev`): figures to tune settings on, not to "
                  "report.**", ""]
    datasets = sorted({d for m in all_metrics.values() for d in m["results"]})
    temps = sorted({t for m in all_metrics.values() for d in m["results"].values() for t in d})
    lines += ["## Every run, per dataset and temperature", ""]
    for dataset in datasets:
        for temp in temps:
            lines += [f"### {dataset}, temperature {temp[1:]}", "", *results_table(all_metrics, dataset, temp), ""]
    lines += ["## Where the time goes", "", *time_split(all_metrics), ""]
    lines += auto_depth_table(all_metrics)
    lines += training or []
    lines += online or []
    lines += serving or []
    lines += reference or []
    lines += ["## Eq. 2 (docs/definitions.md) against measurement", "",
              "Expected tokens per target forward from measured acceptance: with the measured alpha_k chained, with",
              "alpha_pos1 alone (the truncated geometric sum), and its K → ∞ limit 1/(1-alpha), beside measured tau.",
              "Acceptance falls with position for a weak draft, so a single alpha overstates tau.", "",
              *formula_check(all_metrics), "",
              "## Eq. 4 against measurement: alpha = 1 - TV, and the Pinsker bound", "",
              "Where the draft samples (temperature > 0), the decoder records sum min(p, q) and KL(p || q) at the "
              "first",
              "draft position of every round. Their mean should match the measured acceptance there (up to sampling",
              "noise), and no position may fall below 1 - sqrt(KL/2). A prompt-lookup or greedy draft is deterministic",
              "and has no q, so it has no row here.", "",
              *tv_check(all_metrics), "",
              "## Figures", "", "![acceptance by position](acceptance_by_position.png)", "",
              "![speed-up](speedup.png)", "", "![tau vs K](tau_vs_k.png)", ""]
    return "\n".join(lines)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    metrics_dir, out = (Path(cfg["paths"].get("metrics_dir", "metrics")),
                        Path(cfg["paths"].get("reports_dir", "reports")))
    check_outputs(cfg, replaced={"paths.reports_dir": out})
    all_metrics = load_metrics(metrics_dir)
    runs, sweep = load_training(metrics_dir)
    plots_dir = Path(cfg["paths"].get("plots_dir", "plots"))
    curves = load_curves(plots_dir, list(runs))
    online = load_online(metrics_dir, plots_dir)
    serve = load_serving(metrics_dir)
    references = load_reference(metrics_dir)
    reference = reference_tables(references, runs, all_metrics, serve) + data_curve(references, runs, serve)
    experiment = cfg.get("experiment_name", "default")
    with wandb_run(cfg.get("logger"), job_type="report", name=f"report@{experiment}", group=experiment,
                   config=cfg) as run_:
        with atomic_path(out, is_dir=True) as tmp:
            drawn = figures.head_to_head(all_metrics, tmp / "head_to_head.png")  # where it has something to draw
            (tmp / "README.md").write_text(render(all_metrics, experiment,
                                                  render_training(runs, sweep, curves, all_metrics),
                                                  online_tables(online), serving_tables(serve), serve, drawn,
                                                  reference, [*runs.values(), *(r for r, _ in online.values()),
                                                              *references.values()]))
            if serve:
                serving_figure(serve, tmp / "serve_speedup.png")
            if online:
                online_curves(online, tmp / "online_curves.png")
            if curves:
                alpha_curves(curves, tmp / "alpha_curves.png", {n: curve_label(n, runs[n]) for n in curves})
            write_series(plots_dir, tmp / "series")  # what dvc.yaml's plots draw (`dvc plots show`)
            figures.acceptance_by_position(all_metrics, tmp / "acceptance_by_position.png")
            figures.speedup_bars(all_metrics, tmp / "speedup.png")
            figures.tau_vs_k(all_metrics, tmp / "tau_vs_k.png")
        for name, dataset, temp, r in settings(all_metrics):
            run_.summary.update({f"report/{name}/{dataset}/{temp}/{k}": v for k, v in r["spec"].items()
                                 if isinstance(v, int | float)})
        log_figures(run_, out)
    log.info("wrote %s", out / "README.md")
    return {"reports": str(out)}
