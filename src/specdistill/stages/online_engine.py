"""online_engine@M: online speculative distillation with vLLM as the server, against the frozen draft.

The online stage's scenario (`online.*`: the stream, the held-out requests, the update policy, the loss), served
by the real engine instead of our decoder: one engine start serves the stream and the held-out requests with the
offline draft as it is (the frozen curve), then the stream again while the draft learns from the engine's own
verdicts (which drafted tokens it accepted, the target's top-k log-probs there), each new version loaded into the
running engine between two of its steps (online/engine.py, engine/online_worker.py), then the held-out requests
with the draft as the stream left it. The student trains here, in the stage's process, with the online stage's
buffer, policy and Lightning module (an EAGLE-3 head with its target pass over the buffered requests, the separate
draft from the engine's log-probs alone); the engine never restarts and no request is dropped.

Writes `metrics/records/online_engine_<M>.json` (its headline: `metrics/online_engine_<M>.json`),
`plots/online_engine_<M>/{curve,updates}.csv` and the deployed versions `models/online_engine_<M>/`.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from specdistill.core.config import section
from specdistill.core.hardware import environment
from specdistill.core.io import atomic_path
from specdistill.core.models.target import load_target
from specdistill.core.records import metrics_files
from specdistill.core.stage import ConfigError, check_outputs
from specdistill.core.tracking import wandb_run
from specdistill.engine.client import EngineProcess
from specdistill.engine.environment import engine_python
from specdistill.export.target import ExportError, engine_context
from specdistill.online.engine import Channel, EngineServing, request_record, served, throughput, version_rate
from specdistill.online.server import OnlineDistiller, OnlineLog
from specdistill.stages.online import checked_config, log_wandb, request_prompts, summarise, write_outputs

log = logging.getLogger(__name__)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    online_cfg, target_cfg, method = checked_config(cfg)
    serving = section(EngineServing, dict(online_cfg.engine), "online.engine")
    if online_cfg.gate or online_cfg.replay_offline:
        raise ConfigError("online_engine: online.gate and online.replay_offline are our decoder's (online@<m>); "
                          "set them to 0 for the engine")
    paths = cfg["paths"]
    name = f"online_engine_{online_cfg.method}"
    versions = Path(paths.get("models_dir", "models")) / name
    plots = Path(paths.get("plots_dir", "plots")) / name
    metrics_dir = Path(paths.get("metrics_dir", "metrics"))
    if online_cfg.method not in serving.items:
        raise ConfigError(f"online.method={online_cfg.method}: give the draft the engine starts from as "
                          f"online.engine.items.{online_cfg.method}, or use one of {sorted(serving.items)}")
    path = serving.items[online_cfg.method]
    if online_cfg.method not in serving.k:
        raise ConfigError(f"online.method={online_cfg.method}: give the engine's chain length as "
                          f"online.engine.k.{online_cfg.method}")
    k = serving.k[online_cfg.method]
    check_outputs(cfg, names={"online.method": online_cfg.method},
                  replaced={"online.method": versions, "paths.plots_dir": plots},
                  files={"online.method": metrics_files(metrics_dir / f"{name}.json")},
                  inputs={f"online.engine.items.{online_cfg.method}": path})
    if not Path(path).exists():
        raise ConfigError(f"online_engine: no offline draft at {path}: run the stage that trains it "
                          f"(`dvc repro train@draft_full`) or set online.engine.items.{online_cfg.method}")
    target_dir = Path(cfg["export"]["dir"]) / "target"
    if not (target_dir / "config.json").exists():
        raise ExportError(f"online_engine@{online_cfg.method} needs the exported target at {target_dir}: run "
                          "`dvc repro export_target` first")
    engine_context(target_dir, serving.max_model_len, "online.engine.max_model_len")
    engine_python()  # no engine environment: a clear error now, before the target loads
    texts = request_prompts(Path(paths["prompts_dir"]), online_cfg.scenario, online_cfg.requests + online_cfg.held_out)
    target = load_target(target_cfg)
    tok = target.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    if long := [len(p) for p in prompts if len(p) + online_cfg.max_new_tokens > serving.max_model_len]:
        raise ConfigError(f"{len(long)} prompt(s) + online.max_new_tokens exceed online.engine.max_model_len="
                          f"{serving.max_model_len} (the longest: {max(long)} tokens): raise it")
    stream, held_out = prompts[: online_cfg.requests], prompts[online_cfg.requests:]
    student = method.online(online_cfg, target, path, None)  # the engine drafts: no decode settings of ours
    if student.engine_export is None or student.engine_weights is None:
        raise ConfigError(f"online.method={online_cfg.method} does not learn inside the engine (its method registers "
                          "no engine_export / engine_weights)")
    student.module.to(target.device).eval()
    dtype = serving.dtype or str(target.model.dtype).removeprefix("torch.")

    with tempfile.TemporaryDirectory(prefix="specdistill-online-") as tmp_channel, \
            atomic_path(versions, is_dir=True) as out:
        channel = Channel(tmp_channel)
        start = channel.folder / "v0000"
        student.engine_export(start, target_dir)  # the offline draft, as the engine loads it

        def deploy() -> None:  # after each update: the serving copy (saved versions) and the running engine
            student.serving.load_state_dict(student.student.state_dict())
            channel.deploy(student.engine_weights())

        phases = {"frozen": stream + held_out, "online": stream, "held_out": held_out}
        job = {"target": str(target_dir), "dtype": dtype, "max_model_len": serving.max_model_len,
               "seed": online_cfg.seed,
               "speculative_config": method.speculative_config(None, k, str(start)),
               "online": {"channel": str(channel.folder), "concurrency": serving.concurrency,
                          "temperature": online_cfg.temperature, "max_tokens": online_cfg.max_new_tokens,
                          "stop_token_ids": sorted(target.stop_ids), "seed": online_cfg.seed,
                          "wait_s": serving.timeout_s,
                          "phases": [{"name": "frozen", "prompts": phases["frozen"]},
                                     {"name": "online", "prompts": stream, "logprobs": online_cfg.topk, "learn": True},
                                     {"name": "held_out", "prompts": held_out, "after_final": True}]}}
        frozen = OnlineLog()
        online = OnlineDistiller(student.module, None, None, online_cfg, target.stop_ids, target.pad_id, learn=True,
                                 deploy=deploy, save=student.save, save_dir=out)
        rows: dict[str, list[dict[str, Any]]] = {p: [] for p in phases}
        log.info("%s: the engine serves %d + %d requests with the frozen draft, then the stream while it learns, "
                 "then the held-out requests (K=%d, concurrency %d, %s)", name, len(stream), len(held_out),
                 k, serving.concurrency, dtype)
        # vLLM's log to a file of its own, kept (and named in the error) when the engine fails
        engine = EngineProcess(job, threads=serving.threads, iomp=serving.iomp, relay=False)
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(p) for p in phases.values()), desc=name, unit="req", dynamic_ncols=True)
        try:
            for row in channel.requests(engine, serving.timeout_s * 3):
                phase = row["phase"]
                rows[phase].append(row)
                record = request_record(phases[phase][row["index"]], row, k)
                if phase == "frozen":
                    frozen.served.append(served(row, record))
                elif phase == "online":
                    online.observe(record, served(row, record), version_rate(row, k, channel.version))
                    if len(rows["online"]) == len(stream):
                        online.learn = False  # the held-out part measures the draft as the stream left it
                        channel.finish()
                        log.info("%s: stream learnt (%d updates, version %d); the held-out requests next", name,
                                 len(online.log.updates), channel.version)
                else:
                    online.log.served.append(served(row, record))
                bar.set_postfix(phase=phase, version=channel.version, refresh=False)
                bar.update(1)
            result = engine.finish()
        except BaseException:
            engine.kill()
            raise
        finally:
            bar.close()
        student.save(out / "final", len(stream))
    frozen.served.sort(key=lambda s: s.request)  # rows come as requests finish: in order at concurrency 1
    n = len(stream)  # the held-out rows numbered after the stream's, as the frozen log numbers them
    online.log.served = (sorted(online.log.served[:n], key=lambda s: s.request)
                         + sorted((replace(s, request=s.request + n) for s in online.log.served[n:]),
                                  key=lambda s: s.request))
    metrics = summarise(frozen, online.log, online_cfg, len(stream))
    answers = {p: {r["index"]: r["token_ids"] for r in rs} for p, rs in rows.items()}
    after = [answers["online"][i] for i in range(len(stream))] + [answers["held_out"][i] for i in range(len(held_out))]
    same = sum(a == b for a, b in zip(after, [answers["frozen"][i] for i in range(len(prompts))], strict=True))
    metrics["engine"] = {"k": k, "concurrency": serving.concurrency, "dtype": dtype,
                         "versions_loaded": len(result["swaps"]), "final_version": result["final_version"],
                         "load_s": round(sum(s["seconds"] for s in result["swaps"]), 4),
                         "cold_start_s": round(result["cold_start_s"], 2),
                         "identical_to_frozen": {"requests": len(after), "identical": same},
                         **throughput(result["steps"], online.log.updates)}
    metrics["settings"] = {**asdict(online_cfg), "draft_path": path, "target_fingerprint": target.fingerprint,
                           "engine": {"vllm": result.get("vllm"), "torch": result.get("torch"),
                                      "fixes": result.get("fixes")}, **environment()}
    write_outputs(metrics, frozen, online.log, online_cfg.window, metrics_dir, plots, name)
    with wandb_run(cfg.get("logger"), job_type="online", name=f"online_engine@{online_cfg.method}",
                   group=cfg.get("experiment_name", "default"), config=cfg) as wb:
        log_wandb(wb, frozen, online.log, online_cfg.window)
    h = metrics["held_out"]
    log.info("%s: held-out acceptance %.3f learning vs %.3f frozen (%+.3f); %d versions loaded into the engine; "
             "the engine's tokens/s during updates %s vs %s outside; %d/%d answers as the frozen run's", name,
             h["online"]["acceptance_rate"], h["frozen"]["acceptance_rate"], h["gain"],
             len(result["swaps"]), metrics["engine"]["tokens_per_s_during_updates"],
             metrics["engine"]["tokens_per_s_outside"], same, len(after))
    if online_cfg.temperature == 0 and same < len(after):
        log.warning("%s: %d of %d T=0 answers differ from the frozen run's (the verification passes batch the "
                    "positions differently as acceptance changes: %s rounding)", name, len(after) - same,
                    len(after), dtype)
    return metrics
