"""serve@<method>: the real engine (vLLM) serves the exported target with a draft, measures it, checks ours.

The engine runs in a process of its own (`engine.client`), started once without speculation (the AR baseline) and once
per K in `serve.k`, one start after another in that process, each start serving every dataset x temperature x
concurrency run on the evaluate stage's prompts (first turn). Writes `metrics/serve_<m>.json` (settings, cold starts,
tokens/s, latency, acceptance, the speed-up over the engine alone, the K chosen per concurrency) and
`plots/serve_<m>/` (speed-up against concurrency; the engine's acceptance per position beside our decoder's on the
same prompts, same chain, K=agreement_k, T=0).
"""

from __future__ import annotations

import csv
import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from specdistill import methods
from specdistill.core.config import section
from specdistill.core.hardware import environment
from specdistill.core.io import atomic_path
from specdistill.core.models.target import TargetConfig, load_target, load_tokenizer, stop_ids
from specdistill.core.records import headline_of_serving, metrics_files, write_record
from specdistill.core.stage import ConfigError, check_outputs
from specdistill.core.tracking import wandb_run
from specdistill.engine.client import SKIP_IDLE_DRAFTER, engine_python, run_engine, run_engines
from specdistill.engine.serving import (
    AR_LAST,
    MAX_DRIFT,
    ServeConfig,
    acceptance,
    deploy_schedule,
    engine_counts,
    job,
    prompt_requests,
    scheduled_speedups,
    speculative_config,
    summarise,
)
from specdistill.evaluation.accounting import two_proportion_z
from specdistill.evaluation.contention import Contention, busy_warning, cpu_list, own_and_children_cpu_seconds
from specdistill.evaluation.prompts import chat_encoder, load_conversations
from specdistill.export.target import ExportError, engine_context, exported_fingerprint

log = logging.getLogger(__name__)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    serve_cfg = section(ServeConfig, dict(cfg["serve"]), "serve")
    target_cfg = section(TargetConfig, dict(cfg["target"]), "target")
    paths = cfg.get("paths") or {}
    name = f"serve_{serve_cfg.method}"
    metrics_file, plots = (Path(paths.get("metrics_dir", "metrics")) / f"{name}.json",
                           Path(paths.get("plots_dir", "plots")) / name)
    check_outputs(cfg, replaced={"serve.method": plots},
                  files={"serve.method": metrics_files(metrics_file)})
    target_dir, draft_dir = Path(serve_cfg.export_dir) / "target", Path(serve_cfg.items[serve_cfg.method]["engine"])
    method = methods.get(serve_cfg.registered, "serve", f"serve.items.{serve_cfg.method}.method")
    drafted = method.export is not None  # prompt lookup: nothing exported
    # the draft's folder: export@<key>'s, or a checkpoint another stage wrote as it is (reference@<key>'s)
    writer = f"`dvc repro export@{serve_cfg.method}`" if serve_cfg.method == serve_cfg.registered else \
        "the stage that writes it (`dvc stage list` shows which)"
    for need, stage in ((target_dir, "`dvc repro export_target`"), *(((draft_dir, writer),) if drafted else ())):
        if not (need / "config.json").exists():
            raise ExportError(f"serve@{serve_cfg.method} needs {need}: run {stage} first")
    serve_cfg, skipped = servable_k(serve_cfg, method, draft_dir)
    engine_python()  # no engine environment: a clear error now, not after the prompts load
    max_model_len = engine_context(target_dir, serve_cfg.max_model_len, "serve.max_model_len")
    tok = load_tokenizer(target_cfg)
    encode = chat_encoder(tok)
    prompts = {ds: [encode([{"role": "user", "content": c.turns[0]}])
                    for c in load_conversations(Path(paths["prompts_dir"]), ds, serve_cfg.num_prompts, serve_cfg.split)]
               for ds in serve_cfg.datasets}
    if too_long := [(ds, len(p)) for ds, ps in prompts.items() for p in ps
                    if len(p) + serve_cfg.max_new_tokens > max_model_len]:
        raise ConfigError(f"{len(too_long)} prompt(s) + serve.max_new_tokens={serve_cfg.max_new_tokens} exceed the "
                          f"engine's context {max_model_len} (e.g. {too_long[0]}): lower serve.max_new_tokens or "
                          "num_prompts")
    stops = sorted(stop_ids(None, tok))
    dtype = serve_cfg.dtype or target_cfg.dtype
    engine_kw = dict(threads=serve_cfg.threads, iomp=serve_cfg.iomp, multiprocessing=serve_cfg.multiprocessing,
                     timeout_s=serve_cfg.timeout_s)
    settings = [("ar", None)] + [(f"k{k}", speculative_config(serve_cfg, k, str(draft_dir))) for k in serve_cfg.k]
    settings += [(AR_LAST, None)] if serve_cfg.ar_bracket else []
    # one worker process starts the engines in turn: vLLM is imported once, not once per setting
    log.info("engine: %s", "; ".join(f"{setting} ({spec or 'no speculation'})" for setting, spec in settings))
    jobs = [{**job(serve_cfg, str(target_dir), prompts, stops, dtype, spec, max_model_len), "label": setting}
            for setting, spec in settings]
    # what else ran on the engine's cores (serve.threads) while it measured: the engine works in our child (the
    # worker), counted as ours once it is reaped; the share covers every engine start, the deployed schedule's too
    busy = Contention(own=own_and_children_cpu_seconds, cpus=cpu_list(serve_cfg.threads)).start()
    results = dict(zip((s for s, _ in settings), run_engines(jobs, **engine_kw), strict=True))
    for setting, res in results.items():
        log.info("engine: %s cold start %.0f s, shut down in %.0f s", setting, res["cold_start_s"], res["stop_s"])
    summary = summarise(serve_cfg, results)
    deploy = deploy_schedule(serve_cfg, summary["chosen_k"], str(draft_dir) if drafted else None)
    if deploy is not None and len(serve_cfg.concurrency) > 1:  # the schedule as deployed: one more start, every load
        log.info("engine: the chosen schedule %s", deploy["num_speculative_tokens_per_batch_size"])
        idle = {SKIP_IDLE_DRAFTER: "1"} if serve_cfg.skip_idle_drafter else None
        results["scheduled"] = run_engine(job(serve_cfg, str(target_dir), prompts, stops, dtype, deploy, max_model_len),
                                          **engine_kw, env=idle)
        summary = summarise(serve_cfg, results)
    others = busy.stop()
    if warning := busy_warning(others, f"serve@{serve_cfg.method}"):
        log.warning(warning)
    if summary["baseline_drift"]:
        log.warning("serve@%s: the engine alone ran more than %.0f%% apart before and after the K starts in %d run(s) "
                    "(%s): the machine's speed changed during the stage; rerun it on a quiet machine", serve_cfg.method,
                    100 * MAX_DRIFT, len(summary["baseline_drift"]), ", ".join(summary["baseline_drift"][:4]))
    if summary["above_tau"]:
        log.warning("serve@%s: %d run(s) measured a speed-up above their tau (%s): the engine alone ran slow in its "
                    "start (another process on the machine?); rerun the stage on a quiet machine", serve_cfg.method,
                    len(summary["above_tau"]), ", ".join(summary["above_tau"][:4]))
    summary["deploy"] = {"speculative_config": deploy,
                         "speedup_geomean": scheduled_speedups(serve_cfg, summary["results"]) if deploy else {}}
    at_t0 = 0.0 in map(float, serve_cfg.temperatures)
    # an item may opt out where our decoder does not read its draft (a reference checkpoint of another layout)
    agree = at_t0 and serve_cfg.items[serve_cfg.method].get("agreement", True)
    agreement = ours_beside_engine(serve_cfg, target_cfg, prompts, results) if agree else {}
    first = next(iter(results.values()))
    metrics = {"settings": {**environment(), **asdict(serve_cfg), "k_skipped": skipped, "engine": "vllm",
                            "vllm": first["vllm"], "engine_torch": first["torch"],
                            "engine_dtype": dtype, "target_fingerprint": exported_fingerprint(target_dir),
                            "prompts": {ds: len(p) for ds, p in prompts.items()}, "others_cpu_share": others},
               "cold_start_s": {s: round(r["cold_start_s"], 1) for s, r in results.items()},
               "stop_s": {s: round(r["stop_s"], 1) for s, r in results.items() if "stop_s" in r},
               **summary, "agreement": agreement}
    write_record(metrics_file, metrics, headline_of_serving(metrics))
    write_plots(plots, summary, agreement)
    with wandb_run(cfg.get("logger"), job_type="serve", name=f"serve@{serve_cfg.method}",
                   group=cfg.get("experiment_name", "default"), config=cfg) as wb:
        for c, chosen in summary["chosen_k"].items():
            wb.summary.update({f"serve/{c}/k": chosen["k"], f"serve/{c}/speedup": chosen["speedup_geomean"]})
        wb.summary["serve/others_cpu_share"] = others  # a busy machine's flag, as evaluate's
    for c, chosen in summary["chosen_k"].items():
        log.info("%s at concurrency %s: K=%d, %.2fx the engine alone (geomean over datasets and temperatures)",
                 serve_cfg.method, c[1:], chosen["k"], chosen["speedup_geomean"])
    return metrics


def servable_k(serve_cfg: ServeConfig, method: Any, draft_dir: Path) -> tuple[ServeConfig, list[int]]:
    """serve.k without the K this export cannot draft (Medusa: one token per head), and those left out; an error
    when none is left or the agreement's K is among them."""
    if method.max_k is None:
        return serve_cfg, []
    most = method.max_k(str(draft_dir))
    skipped = [k for k in serve_cfg.k if k > most]
    if skipped:
        if serve_cfg.agreement_k in skipped or len(skipped) == len(serve_cfg.k):
            raise ConfigError(f"serve.k={serve_cfg.k}, serve.agreement_k={serve_cfg.agreement_k}: the "
                              f"{serve_cfg.method} export at {draft_dir} drafts at most {most} tokens; list K up to "
                              f"{most}")
        log.warning("serve@%s: the export drafts at most %d tokens, so K=%s are not served", serve_cfg.method, most,
                    skipped)
    return replace(serve_cfg, k=[k for k in serve_cfg.k if k <= most]), skipped


def ours_beside_engine(serve_cfg: ServeConfig, target_cfg: TargetConfig, prompts: dict[str, list[list[int]]],
                       results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Our decoder on the engine's concurrency-1 T=0 requests with the same chain (K = agreement_k), counted as the
    engine counts: accepted prefixes per round, every round that starts before max_new_tokens (the engine drafts
    all K in a request's last round, where our loop shortens the chain to what fits, so ours runs K + 1 further)."""
    from specdistill.decoding.loop import speculative_generate
    from specdistill.decoding.verifier import TargetVerifier
    k = serve_cfg.agreement_k
    target = load_target(target_cfg)
    stops = target.stop_ids
    # our decoder on the same chain as the engine's
    proposer = methods.get(serve_cfg.registered, "serve").agreement_proposer(serve_cfg, target, k)
    verifier = TargetVerifier(target.model, feature_layers=getattr(proposer, "feature_layers", ()))
    out: dict[str, Any] = {}
    c1 = min(serve_cfg.concurrency)
    for ds, plist in prompts.items():
        run = next(r for r in results[f"k{k}"]["runs"]
                   if r["name"].split("|")[0] == ds and float(r["name"].split("|")[1]) == 0.0
                   and int(r["name"].split("|")[2]) == c1)
        engine = acceptance(run["spec"])
        drafts, accepted, per_pos = 0, 0, [0] * k
        for p in prompt_requests(plist, c1):
            res = speculative_generate(verifier, proposer, p, serve_cfg.max_new_tokens + k + 1, stops)
            d, a, pp = engine_counts(res.rounds, serve_cfg.max_new_tokens, k)
            drafts, accepted, per_pos = drafts + d, accepted + a, [x + y for x, y in zip(per_pos, pp, strict=True)]
        ours = acceptance({"vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_accepted_tokens": accepted,
                           "vllm:spec_decode_num_accepted_tokens_per_pos": per_pos})
        out[ds] = {"k": k, "engine": engine, "ours": ours, "z_pos1": two_proportion_z(engine, ours)}
    return out


def write_plots(folder: Path, summary: dict[str, Any], agreement: dict[str, Any]) -> None:
    with atomic_path(folder, is_dir=True) as tmp:
        with open(tmp / "speedup.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["dataset", "temperature", "concurrency", "k", "tokens_per_s", "speedup", "tau"])
            for ds, temps in summary["results"].items():
                for t, cells in temps.items():
                    for c, cell in cells.items():
                        for setting, row in cell.items():
                            if setting != "ar":
                                w.writerow([ds, t[1:], c[1:], setting.removeprefix("k"), row["tokens_per_s"],
                                            row["speedup"], row.get("tau")])
        with open(tmp / "agreement.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["dataset", "position", "engine", "ours"])
            for ds, a in agreement.items():
                for i in range(1, a["k"] + 1):
                    w.writerow([ds, i, a["engine"].get(f"alpha_pos{i}"), a["ours"].get(f"alpha_pos{i}")])

