"""online@M: online speculative distillation measured against the frozen draft, in the same run.

The default scenario is a domain shift: the draft distilled offline on ShareGPT answers (models/<M>)
serves a stream of code requests (HumanEval prompts), learning from its rejections; then a held-out
part of HumanEval is served by the online draft (as it stands after the stream) and by the frozen
offline draft. `scenario=chat` serves held-out ShareGPT prompts instead. The same stream is also
served by the frozen draft, so the two acceptance curves share their requests.

Writes `metrics/records/online_<M>.json` (its headline: `metrics/online_<M>.json`), \
`plots/online_<M>/{curve,updates}.csv` and the deployed versions
`models/online_<M>/v<NNN>-r<requests>/` (safetensors).
"""

from __future__ import annotations

import csv
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdistill import methods
from specdistill.core.config import section
from specdistill.core.hardware import environment
from specdistill.core.io import atomic_path
from specdistill.core.models.target import TargetConfig, load_target
from specdistill.core.records import metrics_files, write_record
from specdistill.core.stage import (
    ConfigError,
    check_outputs,
    cross_limits,
)
from specdistill.core.tracking import wandb_run
from specdistill.decoding.verifier import TargetVerifier
from specdistill.evaluation.prompts import load_prompts
from specdistill.online.policy import OnlineConfig
from specdistill.online.server import OnlineDistiller, OnlineLog
from specdistill.training.losses import LossError, build_loss

log = logging.getLogger(__name__)

STORED_TEACHER_LOSSES = ("fkl", "topk_kl", "ce")


def request_prompts(prompts_dir: Path, scenario: str, n: int) -> list[str]:
    """The first n prompts of the scenario's split (read before the target loads: too few is a config error)."""
    split = {"code": "humaneval", "chat": "val"}[scenario]
    rows = load_prompts(prompts_dir, split)
    if len(rows) < n:
        raise ConfigError(f"online: {n} requests (requests + held_out) but {prompts_dir / split} holds {len(rows)} "
                          "prompts; lower online.requests / online.held_out"
                          + (" or raise data.num_val" if split == "val" else ""))
    return list(rows.select(range(n))["prompt"])


def build_student(online_cfg: OnlineConfig, target: Any, path: str, dec: Any) -> tuple[Any, Any, Any, Any, Any]:
    """(Lightning module with the float32 student, proposer over a serving copy, deploy(), save(dir, requests),
    replay(loss): a live-teacher module sharing the student for offline replay, or None)."""
    student = methods.get(online_cfg.method, "online", "online.method").online(online_cfg, target, path, dec)

    def deploy() -> None:  # the float32 student into the serving copy (cast to the target's dtype)
        student.serving.load_state_dict(student.student.state_dict())

    student.module.to(target.device).eval()  # a LightningModule's `device` follows; the server's Fabric reads it
    return student.module, student.proposer, deploy, student.save, student.replay


def offline_replay(cfg: dict[str, Any], online_cfg: OnlineConfig, target: Any, module: Any,
                   replay: Any = None) -> tuple[Any, Any]:
    """(an endless iterator over the offline training batches, a module with a live teacher sharing the student)."""
    import itertools

    from specdistill.core.data.datamodule import DataConfig, DistillDataModule

    dm = DistillDataModule(DataConfig(batch_size=online_cfg.batch_size, seed=online_cfg.seed),
                           cfg["paths"]["generated_dir"],
                           cfg["paths"]["prompts_dir"], tokenizer=target.tokenizer, pad_id=target.pad_id)
    dm.setup("fit")
    batches = itertools.chain.from_iterable(dm.train_dataloader() for _ in itertools.count())
    # a stored-teacher student replays through a live-teacher module sharing it; otherwise its own module
    return batches, (replay(build_loss(online_cfg.loss)) if replay is not None else module)


def checked_config(cfg: dict[str, Any]) -> tuple[OnlineConfig, TargetConfig, Any]:
    """The online section, the target's and the method, checked before anything loads (online@ and online_engine@):
    types and ranges, the loss, and a stored-teacher method's loss against what it stores."""
    online_cfg = section(OnlineConfig, dict(cfg["online"]), "online")
    target_cfg = section(TargetConfig, dict(cfg["target"]), "target")
    cross_limits(cfg)
    try:
        build_loss(online_cfg.loss)
    except LossError as e:
        raise ConfigError(f"online.loss: {e}") from e
    method = methods.get(online_cfg.method, "online", "online.method")
    if method.online_teacher == "stored" and online_cfg.loss not in STORED_TEACHER_LOSSES:
        raise ConfigError(f"online.loss={online_cfg.loss}: online.method={online_cfg.method} learns from the target's "
                          f"stored top-k at the judged positions; use one of {STORED_TEACHER_LOSSES}")
    return online_cfg, target_cfg, method


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    online_cfg, target_cfg, method = checked_config(cfg)
    dec = methods.decode_settings(cfg, online_cfg.method,
                                  (online_cfg.decode or {}).get(online_cfg.method))  # checked before any load
    models_dir = Path(cfg["paths"].get("models_dir", "models"))
    check_outputs(cfg, names={"online.method": online_cfg.method},
                  replaced={"online.method": models_dir / f"online_{online_cfg.method}",
                            "paths.plots_dir": Path(cfg["paths"].get("plots_dir",
                                                                     "plots")) / f"online_{online_cfg.method}"},
                  files={"online.method": metrics_files(Path(cfg["paths"].get("metrics_dir", "metrics"))
                                                        / f"online_{online_cfg.method}.json")},
                  inputs={f"online.items.{online_cfg.method}": online_cfg.items[online_cfg.method]})
    path = online_cfg.items[online_cfg.method]
    if not Path(path).exists():
        raise ConfigError(f"online: no offline draft at {path}: run `dvc repro train@{online_cfg.method}` "
                          f"or set online.items.{online_cfg.method}")
    texts = request_prompts(Path(cfg["paths"]["prompts_dir"]), online_cfg.scenario,
                            online_cfg.requests + online_cfg.held_out)
    target = load_target(target_cfg)
    tok = target.tokenizer
    stops, pad_id = target.stop_ids, target.pad_id
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    stream, held_out = prompts[: online_cfg.requests], prompts[online_cfg.requests:]
    name = f"online_{online_cfg.method}"
    versions = models_dir / name

    def serve_all(distiller: OnlineDistiller, requests: list[list[int]], label: str) -> None:
        from tqdm.auto import tqdm

        for prompt in tqdm(requests, desc=label, unit="req", dynamic_ncols=True):
            distiller.serve(prompt)

    module, proposer, deploy, save, replay = build_student(online_cfg, target, path, dec)
    verifier = TargetVerifier(target.model, feature_layers=getattr(proposer, "feature_layers", ()))
    frozen = OnlineDistiller(module, proposer, verifier, online_cfg, stops, pad_id, learn=False)
    serve_all(frozen, stream + held_out, "frozen draft")
    offline, offline_module = (offline_replay(cfg, online_cfg, target, module, replay) if online_cfg.replay_offline > 0
                               else (None, None))
    online = OnlineDistiller(module, proposer, verifier, online_cfg, stops, pad_id, learn=True, deploy=deploy,
                             save=save, save_dir=versions, offline=offline, offline_module=offline_module)
    with atomic_path(versions, is_dir=True) as tmp:
        online.save_dir = tmp
        serve_all(online, stream, "online draft")
        online.learn = False  # the held-out part measures the draft as it stands after the stream
        serve_all(online, held_out, "online draft, held out")
        save(tmp / "final", len(stream))
    metrics = summarise(frozen.log, online.log, online_cfg, len(stream))
    metrics["settings"] = {**asdict(online_cfg), "draft_path": path, "target_fingerprint": target.fingerprint,
                           "dtype": target_cfg.dtype, **environment()}
    write_outputs(metrics, frozen.log, online.log, online_cfg.window, Path(cfg["paths"].get("metrics_dir", "metrics")),
                  Path(cfg["paths"].get("plots_dir", "plots")) / name, name)
    with wandb_run(cfg.get("logger"), job_type="online", name=f"online@{online_cfg.method}",
                   group=cfg.get("experiment_name", "default"), config=cfg) as wb:
        log_wandb(wb, frozen.log, online.log, online_cfg.window)
    h = metrics["held_out"]
    log.info("%s: held-out acceptance %.3f online vs %.3f frozen (%+.3f), tau %.2f vs %.2f; %d updates, %.1f s "
             "updating vs %.1f s serving", name, h["online"]["acceptance_rate"], h["frozen"]["acceptance_rate"],
             h["gain"], h["online"]["tau"], h["frozen"]["tau"], len(online.log.updates),
             metrics["time"]["update_s"], metrics["time"]["serve_s"])
    return metrics


def _summary(rows: list[Any]) -> dict[str, float]:
    accepted, judged = sum(r.accepted for r in rows), sum(r.judged for r in rows)
    tokens, rounds = sum(r.tokens for r in rows), sum(r.rounds for r in rows)
    return {"requests": len(rows), "acceptance_rate": round(accepted / judged, 4) if judged else 0.0,
            "tau": round(tokens / (rounds + len(rows)), 4) if rows else 0.0,
            "tokens_per_s": round(tokens / sum(r.seconds for r in rows), 2) if rows else 0.0}


def summarise(frozen: OnlineLog, online: OnlineLog, online_cfg: OnlineConfig, n_stream: int) -> dict[str, Any]:
    out: dict[str, Any] = {"method": online_cfg.method, "scenario": online_cfg.scenario}
    for part, sl in (("stream", slice(0, n_stream)), ("held_out", slice(n_stream, None))):
        f, o = _summary(frozen.served[sl]), _summary(online.served[sl])
        out[part] = {"frozen": f, "online": o, "gain": round(o["acceptance_rate"] - f["acceptance_rate"], 4)}
    out["updates"] = [asdict(u) for u in online.updates]
    out["stopped_at"] = online.stopped_at
    out["resumed_at"] = online.resumed_at
    serve_s = sum(r.seconds for r in online.served)
    update_s = sum(u.seconds for u in online.updates)
    out["time"] = {"serve_s": round(serve_s, 2), "update_s": round(update_s, 2),
                   "update_share": round(update_s / (serve_s + update_s), 4) if serve_s + update_s else 0.0}
    return out


def moving(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i + 1 - window):i + 1]) / len(values[max(0, i + 1 - window):i + 1])
            for i in range(len(values))]


def write_outputs(metrics: dict[str, Any], frozen: OnlineLog, online: OnlineLog, window: int, metrics_dir: Path,
                  plots: Path, name: str) -> None:
    # the headline: acceptance gained over the frozen draft, on the stream and on the held-out requests
    write_record(metrics_dir / f"{name}.json", metrics,
                 {f"{part}_gain": metrics[part]["gain"] for part in ("stream", "held_out")})
    f_rates = [r.acceptance_rate for r in frozen.served]
    o_rates = [r.acceptance_rate for r in online.served]
    with atomic_path(plots, is_dir=True) as tmp:
        with open(tmp / "curve.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["request", "frozen", "online", "frozen_window", "online_window", "version"])
            for i, (a, b, ma, mb) in enumerate(zip(f_rates, o_rates, moving(f_rates, window), moving(o_rates, window),
                                                   strict=True)):
                w.writerow([i, round(a, 4), round(b, 4), round(ma, 4), round(mb, 4), online.served[i].version])
        with open(tmp / "updates.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["request", "seconds", "loss", "positions", "buffer_requests", "buffer_rejected", "gate_before",
                        "gate_after", "deployed"])
            for u in online.updates:
                w.writerow([u.request, round(u.seconds, 3), round(u.loss, 5), u.positions, u.buffer_requests,
                            u.buffer_rejected, "" if u.gate_before is None else round(u.gate_before, 4),
                            "" if u.gate_after is None else round(u.gate_after, 4), int(u.deployed)])


def log_wandb(run: Any, frozen: OnlineLog, online: OnlineLog, window: int) -> None:
    if not hasattr(run, "id"):  # logging disabled
        return
    f = moving([r.acceptance_rate for r in frozen.served], window)
    o = moving([r.acceptance_rate for r in online.served], window)
    for i, (a, b) in enumerate(zip(f, o, strict=True)):
        run.log({"online/request": i, "online/acceptance_frozen": a, "online/acceptance_online": b,
                 "online/tau_online": online.served[i].tau, "online/version": online.served[i].version})
    for u in online.updates:
        run.log({"online/update_request": u.request, "online/update_seconds": u.seconds, "online/update_loss": u.loss,
                 "online/update_deployed": int(u.deployed),
                 **({} if u.gate_before is None
                    else {"online/gate_before": u.gate_before, "online/gate_after": u.gate_after})})
