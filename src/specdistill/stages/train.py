"""train@M: distill a draft of method M from the frozen target with Lightning.

Writes `models/<M>/` (the draft: a plain HF folder, + d2t for a reduced vocabulary),
`metrics/train_<M>.json` (the final validation acceptance with the settings) and
`plots/train_<M>/val.csv` (val/alpha against step: the acceptance curve). Checkpoints go to
`checkpoints/<M>/` under a fingerprint of everything that shapes the run, so a killed stage resumes
from `last.ckpt` and a changed config starts afresh. In a Hydra multirun (`-m draft=xs,s loss=fkl,tvd`)
each job writes into its own output folder and its metrics to `metrics/sweep/`, where the report
stage reads the sweep table from.
"""

from __future__ import annotations

import csv
import logging
import os
import shutil
import warnings
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lightning.pytorch.callbacks import Callback, TQDMProgressBar

from specdistill import methods
from specdistill.data.datamodule import DataConfig, DataError, DistillDataModule
from specdistill.data.features import check_store
from specdistill.data.generation import stop_ids
from specdistill.io import atomic_path, config_hash, has_stamp
from specdistill.models.draft_lm import (
    DraftSize,
)
from specdistill.models.heads_io import read_settings
from specdistill.models.target import TargetConfig, load_target
from specdistill.outputs import check_replaceable
from specdistill.records import headline_of_training, metrics_files, write_record
from specdistill.stages.common import ConfigError, check_outputs, environment, section
from specdistill.tracking import log_folder
from specdistill.training.base import build_optimizer
from specdistill.training.losses import LossError, build_loss

log = logging.getLogger(__name__)

# DistillDataModule's sampler continues a resumed epoch at the checkpoint's batch (BatchPlanSampler.skip), which
# Lightning cannot see from outside: its warning that the loader restarts the epoch does not hold here
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")

# the keys of a `methods.<m>` section the train stage reads itself (the method's dataclass gets the rest):
# the draft's size (methods that size one), its loss, optimizer and what it sets over distill.data
TRAINING_KEYS = ("draft", "loss", "optimizer", "data")


@dataclass
class LossConfig:
    RANGES: ClassVar[dict[str, str]] = {"temperature": "(0, inf)"}  # checked by `section`
    name: str  # each method chooses its own (methods.<m>.loss): no default here
    temperature: float = 1.0
    params: dict[str, Any] | None = field(default_factory=dict)  # null: none (e.g. loss.name=ce over jsd's params)


@dataclass
class DistillConfig:
    teacher: str = "live"
    data: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] | None = None
    tau_k: int = 4
    max_k: int = 8
    output: str | None = None  # outputs' name: models/<output>, metrics/train_<output>.json; default the method
    RANGES: ClassVar[dict[str, str]] = {"tau_k": "[1, 64]", "max_k": "[1, 64]"}  # checked by `section`


@dataclass
class Plan:
    """Where a run writes, decided before anything heavy loads."""

    model_dir: Path
    ckpt_dir: Path
    metrics_file: Path
    plots_dir: Path | None
    run_name: str


@dataclass(frozen=True)
class Job:
    """A Hydra multirun job, as the front door (pipelines/_entry.py) saw it: its own folder, its value of every
    swept override (`loss@methods.draft.loss=fkl`, ...) and its number."""

    dir: Path
    swept: tuple[str, ...]
    num: int

    def name(self, method: str) -> str:
        """No two jobs of a sweep share metrics or a W&B run: the swept values, else the job number."""
        parts = [s.replace("/", "_") for s in self.swept]
        return f"{method}-{'-'.join(parts)}" if parts else f"{method}-job{self.num}"


def plan_outputs(cfg: dict[str, Any], method: str, draft: str, loss: str, output: str | None = None,
                 job: Job | None = None) -> Plan:
    paths = cfg["paths"]
    name = f"{method}-{draft}-{loss}"
    method = output or method
    if job is not None:
        name = job.name(method)
        return Plan(job.dir / "model", job.dir / "checkpoints",
                    Path(paths.get("metrics_dir", "metrics")) / "sweep" / f"{name}.json", None, name)
    return Plan(Path(paths.get("models_dir", "models")) / method, Path(paths.get("checkpoints_dir", "checkpoints")) / method,
                Path(paths.get("metrics_dir", "metrics")) / f"train_{method}.json",
                Path(paths.get("plots_dir", "plots")) / f"train_{method}", name)


def resume_point(ckpt_dir: Path, stamp: str) -> tuple[str | None, str | None]:
    """(checkpoint, W&B run id) of an interrupted run of the same configuration, else (None, None).

    `last.ckpt` when it reads whole; else the newest other checkpoint that does (a run killed, or a disk
    filled, while Lightning wrote a checkpoint leaves a truncated file); a clear error when none does.
    Read-only: every rank decides from the same files before any rank changes them; rank zero
    clears a foreign folder later (`CheckpointDir`), once all processes have started.
    """
    if not has_stamp(ckpt_dir, stamp):
        return None, None
    run_id_file = ckpt_dir / "wandb_id"
    run_id = run_id_file.read_text().strip() if run_id_file.exists() else None
    last = ckpt_dir / "last.ckpt"
    older = sorted((p for p in ckpt_dir.glob("*.ckpt") if p.name != "last.ckpt" and not p.is_symlink()),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    candidates = [p for p in (last, *older) if p.exists()]
    for i, ckpt in enumerate(candidates):
        if readable_checkpoint(ckpt):
            if i:
                log.warning("%s is damaged (cut off?): resuming from the newest whole checkpoint, %s",
                            candidates[0], ckpt)
            return str(ckpt), run_id
    if candidates:
        raise ConfigError(f"the checkpoints of this configuration in {ckpt_dir} are damaged "
                          f"({', '.join(p.name for p in candidates)}: cut off, or a full disk): none can resume. "
                          f"Delete {ckpt_dir} to train this configuration afresh")
    return None, run_id


def readable_checkpoint(path: Path) -> bool:
    """Whether a torch checkpoint (a zip archive) reads whole: every member present with its CRC."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError):
        return False


class CheckpointDir(Callback):
    """On rank zero, a fresh checkpoint folder unless this configuration resumes from it."""

    def __init__(self, ckpt_dir: Path, stamp: str, run_id: str):
        self.ckpt_dir, self.stamp, self.run_id = ckpt_dir, stamp, run_id

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.is_global_zero:
            if (self.ckpt_dir.exists() or self.ckpt_dir.is_symlink()) and not has_stamp(self.ckpt_dir, self.stamp):
                check_replaceable(self.ckpt_dir, "distill.output", markers=("FINGERPRINT",))  # ours, or refused
                log.warning("%s holds checkpoints of another configuration: starting afresh", self.ckpt_dir)
                shutil.rmtree(self.ckpt_dir)
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            (self.ckpt_dir / "FINGERPRINT").write_text(self.stamp + "\n")
            (self.ckpt_dir / "wandb_id").write_text(self.run_id + "\n")
        trainer.strategy.barrier("checkpoint-dir")


def _wandb_logger(logger_cfg: dict[str, Any] | None, run_id: str, run_name: str, group: str,
                  config: dict[str, Any]) -> Any:
    cfg = dict(logger_cfg or {})
    if not cfg.get("enabled", False):
        return False
    from lightning.pytorch.loggers import WandbLogger

    os.makedirs(cfg.get("dir", "."), exist_ok=True)
    mode = os.environ.get("WANDB_MODE", cfg.get("mode", "offline"))
    return WandbLogger(project=cfg.get("project", "specdistill"), entity=cfg.get("entity"), group=group,
                       job_type="train", name=run_name, tags=list(cfg.get("tags") or []), mode=mode,
                       save_dir=cfg.get("dir", "."), id=run_id, resume="allow", config=config)


def method_sections(cfg: dict[str, Any], key: str) -> tuple[Any, Any, DraftSize | None, LossConfig, dict[str, Any]]:
    """`methods.<key>` checked: the registered method (its `name`), its own config, its draft size (methods that
    size one), its loss, and the distill section it trains with (its optimizer, its data keys, its teacher)."""
    if key not in (cfg.get("methods") or {}):
        raise ConfigError(f"method={key}: no methods.{key} section; use one of {sorted(cfg.get('methods') or {})} "
                          f"(a new one: conf/methods/{key}.yaml, listed in conf/config.yaml's defaults)")
    own = dict(cfg["methods"][key])
    name = own.get("name", key)
    method = methods.get(name, "train", f"methods.{key}.name")
    shared = {k: own.pop(k) for k in TRAINING_KEYS if k in own}  # what every method trains with, set per method
    missing = [k for k in ("loss", "optimizer") if k not in shared]
    if missing:
        raise ConfigError(f"methods.{key} has no {' / '.join(missing)}: its conf/methods/ file's defaults list "
                          "`/loss@loss: <name>` and `/optimizer@optimizer: adamw`")
    mcfg = section(method.config, own, f"methods.{key}")
    if method.check is not None:
        method.check(mcfg)
    if method.uses_draft_size != ("draft" in shared):
        raise ConfigError(f"methods.{key}.draft: " + (f"{name} sizes its draft there (conf/draft/)" if method.uses_draft_size
                                                      else f"{name} takes no draft size; remove it"))
    size = section(DraftSize, dict(shared["draft"]), f"methods.{key}.draft") if method.uses_draft_size else None
    lcfg = section(LossConfig, dict(shared["loss"]), f"methods.{key}.loss")
    distill = {**cfg["distill"], "optimizer": shared["optimizer"],
               "data": {**cfg["distill"]["data"], **(shared.get("data") or {})}}
    if getattr(mcfg, "teacher", None):  # methods.<m>.teacher wins over distill.teacher (an experiment's EAGLE choice)
        distill["teacher"] = mcfg.teacher
    return method, mcfg, size, lcfg, distill


def run(cfg: dict[str, Any], job: Job | None = None) -> dict[str, Any]:
    """Distill `methods.<cfg.method>`; `job`: the Hydra multirun job this run is (None: a single run)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    # every section is checked before the target loads: a bad config fails at start
    key = cfg.get("method")
    method, mcfg, size, lcfg, distill = method_sections(cfg, key)
    name = method.name
    dist = section(DistillConfig, distill, "distill")
    cfg = {**cfg, "distill": distill}  # what this method trains with: the settings and the stamp say so
    dcfg = section(DataConfig, dict(dist.data), "distill.data")  # methods.<key>.data over it
    tcfg = section(TargetConfig, dict(cfg["target"]), "target")
    try:
        loss = build_loss(lcfg.name, lcfg.temperature, **(lcfg.params or {}))  # null: none
    except LossError as e:
        raise ConfigError(f"methods.{key}.loss: {e}") from e
    if method.reads_hidden and (dist.teacher == "stored" or dcfg.source not in ("target", "dataset")):
        raise ConfigError(f"method={key} reads the frozen target's hidden states on fixed data: it needs distill.teacher=live "
                          f"or precomputed (got {dist.teacher}) and distill.data.source=target or dataset (got {dcfg.source})")
    if dist.teacher == "precomputed" and (not method.precomputed or dcfg.source != "target"):
        raise ConfigError(f"distill.teacher=precomputed reads the features stage's store, made for EAGLE heads "
                          f"(method={'/'.join(n for n in methods.names('train') if methods.REGISTRY[n].precomputed)}) "
                          f"on the generate stage's answers (distill.data.source=target); "
                          f"got method={key}, source={dcfg.source}: use distill.teacher=live")
    if dist.teacher == "stored" and dcfg.source in ("draft", "mix"):
        raise ConfigError(f"distill.data.source={dcfg.source} trains on the draft's own samples, which have no stored "
                          "top-k: use distill.teacher=live")
    if dist.teacher in ("stored", "precomputed") and loss.needs_full_teacher:
        raise ConfigError(f"methods.{key}.loss={lcfg.name} needs the target's full distribution; distill.teacher={dist.teacher} "
                          f"keeps only its top-k: use distill.teacher=live or loss fkl / topk_kl")
    optimizer = build_optimizer(dist.optimizer, f"methods.{key}.optimizer")
    scheduler = build_optimizer(dist.scheduler, "distill.scheduler", probe=False) if dist.scheduler else None
    trainer_kwargs = {**dict(cfg["trainer"]), **(mcfg.trainer or {})}  # methods.<m>.trainer wins (every method has one)
    label = method.label(mcfg, size) if method.label else name
    check_outputs(cfg, names={"distill.output": dist.output or key, f"methods.{key}.loss.name": lcfg.name,
                              f"methods.{key}": label})
    plan = plan_outputs(cfg, key, label, lcfg.name, dist.output, job)
    check_outputs(cfg, replaced={"distill.output": plan.model_dir,
                                 **({"paths.plots_dir": plan.plots_dir} if plan.plots_dir else {})},
                  fingerprinted={"paths.checkpoints_dir": plan.ckpt_dir},
                  files={"paths.metrics_dir": metrics_files(plan.metrics_file)})
    generated = Path(cfg["paths"]["generated_dir"])
    data_stamp = (generated / "FINGERPRINT").read_text().strip() if (generated / "FINGERPRINT").exists() else "none"

    target = load_target(tcfg)
    features_dir = None
    if dist.teacher == "precomputed":  # the store must fit this run: same data, target, spans and layers
        features_dir = Path(cfg["paths"].get("features_dir", "data/features"))
        layers = mcfg.layers(target.model.config.num_hidden_layers)
        try:
            store = check_store(features_dir, layers, dcfg.max_length, data_stamp, target.fingerprint)
        except DataError as e:
            raise ConfigError(str(e)) from e
        data_stamp = f"{data_stamp}+features:{store['fingerprint']}"  # a new store (other k, dtype) starts afresh
    stops, pad_id = stop_ids(target.model, target.tokenizer), target.tokenizer.pad_token_id or 0
    datamodule = DistillDataModule(dcfg, generated, cfg["paths"]["prompts_dir"], tokenizer=target.tokenizer,
                                   pad_id=pad_id, features_dir=features_dir)
    datamodule.setup("fit")
    common = dict(loss=loss, optimizer=optimizer, scheduler=scheduler, teacher=dist.teacher, tau_k=dist.tau_k,
                  max_k=dist.max_k)
    # one seed for all the student draws from torch, numpy and random: a run's weights must not depend on
    # what the process drew before (Medusa's residual biases drew from it; EAGLE's and the draft's
    # builders reseed anyway, so their runs are unchanged)
    pl.seed_everything(int(cfg.get("seed", 0)), workers=True, verbose=False)
    built = method.build(mcfg, size, dcfg, cfg, target, datamodule, stops, pad_id, common)
    module = built.module
    stamp = config_hash({"method": asdict(mcfg), "draft": asdict(size) if size else None, "loss": asdict(lcfg), "distill": cfg["distill"],
                         "trainer": trainer_kwargs, "target": target.fingerprint, "data": data_stamp, "seed": cfg.get("seed")})
    ckpt_path, run_id = resume_point(plan.ckpt_dir, stamp)
    if ckpt_path:
        log.info("resuming from %s", ckpt_path)
    run_id = run_id or f"{stamp[:8]}-{os.urandom(3).hex()}"  # a resumed stage continues its W&B run
    group = cfg.get("experiment_name", "default")
    logger = _wandb_logger(cfg.get("logger"), run_id, plan.run_name, group, cfg)
    # after every validation pass, so a checkpoint holds the acceptance curve up to its step
    checkpoint = ModelCheckpoint(dirpath=plan.ckpt_dir, filename="step{step}", save_last="link", save_top_k=1,
                                 save_on_train_epoch_end=False, auto_insert_metric_name=False)
    # tqdm, as the other stages: Lightning's default with `rich` installed draws nothing into a log file
    # (`nohup dvc repro > log`), so an hour of training would show no progress there
    bar = [TQDMProgressBar()] if trainer_kwargs.get("enable_progress_bar", True) else []
    try:
        trainer = pl.Trainer(**trainer_kwargs, logger=logger, use_distributed_sampler=False,
                             callbacks=[CheckpointDir(plan.ckpt_dir, stamp, run_id), checkpoint, *bar],
                             default_root_dir=str(plan.ckpt_dir))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"trainer: {e}") from e
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    final = {k: float(v) for k, v in trainer.validate(module, datamodule=datamodule, verbose=False)[0].items()}
    history = {row["step"]: row for row in module.val_history}  # the final pass may repeat the last step
    result = {"method": name, "final": final, "steps": trainer.global_step,
              "settings": {"method": asdict(mcfg), "draft": asdict(size) if size else None, "loss": asdict(lcfg), "distill": cfg["distill"],
                           "trainer": trainer_kwargs, "experiment": group, "target_fingerprint": target.fingerprint,
                           "train_tokens": datamodule.num_train_tokens, "val_tokens": datamodule.num_val_tokens,
                           "draft_parameters": sum(p.numel() for p in built.student.parameters()),
                           "draft_vocab": None if module.d2t is None else len(module.d2t), **environment()}}
    code_fraction = (cfg.get("data") or {}).get("code_fraction")
    if code_fraction is not None:  # only then, so a run on the source's own mix keeps its settings as they were
        result["settings"]["prompt_mix"] = {"code_fraction": code_fraction}
    if mcfg.init_from:  # only then: a run from scratch keeps its settings as they were
        result["settings"]["lineage"] = lineage(mcfg.init_from)
    if hasattr(module, "trees"):  # Medusa: the per-rank accuracies and the trees grown from them
        result["trees"] = module.trees()
    if trainer.is_global_zero:
        built.save(plan.model_dir, result["settings"])
        write_record(plan.metrics_file, result, headline_of_training(result))
        if plan.plots_dir is not None:
            write_curve(sorted(history.values(), key=lambda r: r["step"]), plan.plots_dir)
        log.info("%s: val/alpha %.3f, alpha at T=0 %.3f, tau_sim(K=%d) at T=0 %.2f after %d steps -> %s", plan.run_name,
                 final.get("val/alpha", 0), final.get("val/alpha_t0", 0), dist.tau_k, final.get("val/tau_sim_t0", 0),
                 trainer.global_step, plan.model_dir)
    if logger:
        if trainer.is_global_zero:
            log_folder(logger.experiment, plan.model_dir, f"train@{plan.run_name}")
        logger.experiment.finish()  # a multirun's next job gets its own run
    return result



def lineage(init_from: str) -> list[dict[str, Any]]:
    """The runs a continued draft went through, oldest first: run name, steps, train tokens and prompt mix of
    each, read from the settings saved beside every folder (a folder saved without settings is named only).

    A report can then say what a continued run stands on without the machine's paths."""
    s = read_settings(init_from)
    if not s:
        return [{"run": Path(init_from).name}]
    before = s.get("lineage")
    if before is None:  # saved before lineage was recorded: follow its own init_from (named only once it is gone)
        parent = s.get("method", {}).get("init_from")
        before = lineage(parent) if parent else []
    entry = {"run": s.get("distill", {}).get("output") or Path(init_from).name,
             "steps": s.get("trainer", {}).get("max_steps"), "train_tokens": s.get("train_tokens")}
    if s.get("prompt_mix"):
        entry["prompt_mix"] = s["prompt_mix"]
    return [*before, entry]


def write_curve(rows: list[dict[str, Any]], plots_dir: Path) -> None:
    """val.csv: every validation figure against step (the acceptance curve; Medusa adds its per-head columns)."""
    present = {k for r in rows for k in r}
    keys = ["step"] + [k for k in ("val/alpha", "val/alpha_t0", "val/tau_sim", "val/tau_sim_t0") if k in present]
    keys += sorted(k for k in present if k.startswith(("val/head", "val/tau_tree")))
    with atomic_path(plots_dir, is_dir=True) as tmp:
        with open(tmp / "val.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([k.replace("val/", "") for k in keys])
            for r in rows:
                w.writerow([r.get(k) for k in keys])
