"""train@M: distill a draft (the one `methods.M` configures) from the frozen target with Lightning.

Writes `models/<M>/` (the draft: a plain HF folder, + d2t for a reduced vocabulary),
`metrics/train_<M>.json` (the final validation acceptance; the settings in metrics/records/) and
`plots/train_<M>/val.csv` (val/alpha against step: the acceptance curve). Checkpoints go to
`checkpoints/<M>/` under a fingerprint of everything that shapes the run, so a killed stage resumes
from `last.ckpt` and a changed config starts afresh. In a Hydra multirun (`-m draft=xs,s loss=fkl,tvd`)
each job writes into its own output folder and its metrics to `<paths.metrics_dir>/sweep/`, where the report
stage reads the sweep table from.

Read top to bottom: `run` (check, load, build, fit, write), then the checks it makes before the target
loads, then where it writes. Checkpoints: training/checkpoints.py; the curve and lineage: training/outputs.py.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lightning.pytorch.callbacks import TQDMProgressBar

from specdistill import methods
from specdistill.core.config import section
from specdistill.core.data.datamodule import DataConfig, DataError, DistillDataModule
from specdistill.core.data.features import check_store
from specdistill.core.hardware import auto_precision, environment
from specdistill.core.io import config_hash
from specdistill.core.models.target import TargetConfig, load_target
from specdistill.core.records import headline_of_training, metrics_files, write_record
from specdistill.core.stage import ConfigError, check_outputs
from specdistill.core.tracking import lightning_logger, log_folder
from specdistill.training.base import build_optimizer
from specdistill.training.checkpoints import CheckpointDir, readable_checkpoint, resume_point  # noqa: F401
from specdistill.training.losses import LossError, build_loss
from specdistill.training.outputs import lineage, write_curve
from specdistill.training.throughput import Throughput

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


def run(cfg: dict[str, Any], job: Job | None = None) -> dict[str, Any]:
    """Distill `methods.<cfg.method>`; `job`: the Hydra multirun job this run is (None: a single run)."""
    import lightning.pytorch as pl

    c = check(cfg, job)  # every section and output, before the target loads: a bad config fails at start
    cfg = c.cfg
    target = load_target(c.target)
    datamodule, data_stamp = data_for(c, target)
    # one seed for all the student draws from torch, numpy and random: a run's weights must not depend on
    # what the process drew before (Medusa's residual biases drew from it; EAGLE's and the draft's
    # builders reseed anyway, so their runs are unchanged)
    pl.seed_everything(int(cfg.get("seed", 0)), workers=True, verbose=False)
    stops, pad_id = target.stop_ids, target.pad_id
    common = dict(loss=c.loss, optimizer=c.optimizer, scheduler=c.scheduler, teacher=c.distill.teacher,
                  tau_k=c.distill.tau_k, max_k=c.distill.max_k)
    built = c.method.build(methods.TrainContext(c.mcfg, c.size, c.data, cfg, target, datamodule, stops, pad_id, common))
    module = built.module
    stamp = config_hash({"method": asdict(c.mcfg), "draft": asdict(c.size) if c.size else None,
                         "loss": asdict(c.loss_cfg), "distill": cfg["distill"], "trainer": c.trainer,
                         "target": target.fingerprint, "data": data_stamp, "seed": cfg.get("seed")})
    trainer, logger, ckpt_path = lightning_trainer(c, cfg, stamp)
    throughput = next(cb for cb in trainer.callbacks if isinstance(cb, Throughput))
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    final = {k: float(v) for k, v in trainer.validate(module, datamodule=datamodule, verbose=False)[0].items()}
    result = record(c, cfg, final, trainer.global_step, target, datamodule, built)
    result["run"] = throughput.record()  # this process's steps: a resumed run's own
    if trainer.is_global_zero:
        built.save(c.plan.model_dir, result["settings"])
        write_record(c.plan.metrics_file, result, headline_of_training(result))
        if c.plan.plots_dir is not None:
            history = {row["step"]: row for row in module.val_history}  # the final pass may repeat the last step
            write_curve(sorted(history.values(), key=lambda r: r["step"]), c.plan.plots_dir)
        log.info("%s: val/alpha %.3f, alpha at T=0 %.3f, tau_sim(K=%d) at T=0 %.2f after %d steps -> %s",
                 c.plan.run_name, final.get("val/alpha", 0), final.get("val/alpha_t0", 0), c.distill.tau_k,
                 final.get("val/tau_sim_t0", 0), trainer.global_step, c.plan.model_dir)
    if logger:
        if trainer.is_global_zero:
            log_folder(logger.experiment, c.plan.model_dir, f"train@{c.plan.run_name}")
        logger.experiment.finish()  # a multirun's next job gets its own run
    return result


@dataclass
class Checked:
    """Everything `run` needs, checked before the target loads."""

    cfg: dict[str, Any]  # with `distill` as this method trains with it (its optimizer, data keys, teacher)
    key: str
    method: Any
    mcfg: Any
    size: Any  # the method's draft size (its `draft_size` dataclass), or None
    loss_cfg: LossConfig
    distill: DistillConfig
    data: DataConfig
    target: TargetConfig
    loss: Any
    optimizer: Any
    scheduler: Any
    trainer: dict[str, Any]
    plan: Plan


def check(cfg: dict[str, Any], job: Job | None) -> Checked:
    key = cfg.get("method")
    method, mcfg, size, loss_cfg, distill = method_sections(cfg, key)
    dist = section(DistillConfig, distill, "distill")
    cfg = {**cfg, "distill": distill}  # what this method trains with: the settings and the stamp say so
    data_cfg = section(DataConfig, dict(dist.data), "distill.data")  # methods.<key>.data over it
    target_cfg = section(TargetConfig, dict(cfg["target"]), "target")
    try:
        loss = build_loss(loss_cfg.name, loss_cfg.temperature, **(loss_cfg.params or {}))  # null: none
    except LossError as e:
        raise ConfigError(f"methods.{key}.loss: {e}") from e
    check_teacher(key, method, dist, data_cfg, loss_cfg, loss)
    optimizer = build_optimizer(dist.optimizer, f"methods.{key}.optimizer")
    scheduler = build_optimizer(dist.scheduler, "distill.scheduler", probe=False) if dist.scheduler else None
    trainer_kwargs = {**dict(cfg["trainer"]), **(mcfg.trainer or {})}  # methods.<m>.trainer wins (every method has one)
    check_trainer(dict(cfg["trainer"]), "trainer")
    check_trainer(dict(mcfg.trainer or {}), f"methods.{key}.trainer")
    if trainer_kwargs.get("precision") == "auto":  # resolved here, so the record and the stamp name what ran
        trainer_kwargs["precision"] = auto_precision(str(trainer_kwargs.get("accelerator", "auto")))
    label = method.label(mcfg, size) if method.label else method.name
    check_outputs(cfg, names={"distill.output": dist.output or key, f"methods.{key}.loss.name": loss_cfg.name,
                              f"methods.{key}": label})
    plan = plan_outputs(cfg, key, label, loss_cfg.name, dist.output, job)
    check_outputs(cfg, replaced={"distill.output": plan.model_dir,
                                 **({"paths.plots_dir": plan.plots_dir} if plan.plots_dir else {})},
                  fingerprinted={"paths.checkpoints_dir": plan.ckpt_dir},
                  files={"paths.metrics_dir": metrics_files(plan.metrics_file)},
                  inputs={f"methods.{key}.init_from": mcfg.init_from})
    return Checked(cfg, key, method, mcfg, size, loss_cfg, dist, data_cfg, target_cfg, loss, optimizer, scheduler,
                   trainer_kwargs,
                   plan)


# Lightning's keys whose wrong value fails only inside `fit`, after the checkpoint folder of the previous
# configuration was replaced (`val_check_interval=0`: a bare ZeroDivisionError), or fails naming no key:
# (what it must be, the test). Keys not listed are Lightning's to check when the Trainer is built.
_TRAINER_KEYS: dict[str, tuple[str, Any]] = {
    "max_steps": ("an integer >= -1 (-1: no limit; 0: validate only)", lambda v: _int(v) and v >= -1),
    "max_epochs": ("null or an integer >= -1", lambda v: v is None or _int(v) and v >= -1),
    "val_check_interval": ("an integer >= 1 (steps) or a fraction of an epoch in (0, 1]",
                           lambda v: v is None or _int(v) and v >= 1 or _num(v) and 0 < v <= 1),
    "check_val_every_n_epoch": ("null or an integer >= 1", lambda v: v is None or _int(v) and v >= 1),
    # > 0: the run's record is its final validation (0 would fail after the whole training)
    "limit_val_batches": ("an integer >= 1 (batches) or a fraction in (0, 1]: the stage's record is the final "
                          "validation", lambda v: _int(v) and v >= 1 or _num(v) and 0 < v <= 1),
    "limit_train_batches": ("an integer >= 1 (batches) or a fraction in (0, 1]",
                            lambda v: _int(v) and v >= 1 or _num(v) and 0 < v <= 1),
    "log_every_n_steps": ("an integer >= 1", lambda v: _int(v) and v >= 1),
    "accumulate_grad_batches": ("an integer >= 1", lambda v: _int(v) and v >= 1),
    "gradient_clip_val": ("null or a number >= 0", lambda v: v is None or _num(v) and v >= 0),
    "num_sanity_val_steps": ("an integer >= -1", lambda v: _int(v) and v >= -1),
    "fast_dev_run": ("true, false or an integer >= 0", lambda v: isinstance(v, bool) or _int(v) and v >= 0),
    "devices": ("an integer >= 1, a list of device ids, or auto",
                lambda v: _int(v) and v >= 1 or isinstance(v, list | str) and v not in ("", [])),
}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_trainer(trainer: dict[str, Any], where: str) -> None:
    """The trainer keys that Lightning checks late, checked at start, the key, value and range named."""
    for key, value in trainer.items():
        if key in _TRAINER_KEYS and not _TRAINER_KEYS[key][1](value):
            raise ConfigError(f"`{where}.{key}={value!r}`: must be {_TRAINER_KEYS[key][0]}")


def method_sections(cfg: dict[str, Any], key: str) -> tuple[Any, Any, Any, LossConfig, dict[str, Any]]:
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
    if (method.draft_size is not None) != ("draft" in shared):
        raise ConfigError(f"methods.{key}.draft: " + (f"{name} sizes its draft there (conf/draft/)" if method.draft_size
                                                      else f"{name} takes no draft size; remove it"))
    size = section(method.draft_size, dict(shared["draft"]), f"methods.{key}.draft") if method.draft_size else None
    loss_cfg = section(LossConfig, dict(shared["loss"]), f"methods.{key}.loss")
    distill = {**cfg["distill"], "optimizer": shared["optimizer"],
               "data": {**cfg["distill"]["data"], **(shared.get("data") or {})}}
    if getattr(mcfg, "teacher", None):  # methods.<m>.teacher wins over distill.teacher (an experiment's EAGLE choice)
        distill["teacher"] = mcfg.teacher
    return method, mcfg, size, loss_cfg, distill


def check_teacher(key: str, method: Any, dist: DistillConfig, data_cfg: DataConfig, loss_cfg: LossConfig,
                  loss: Any) -> None:
    """The teacher, the data source and the loss must fit together and the method."""
    if method.reads_hidden and (dist.teacher == "stored" or data_cfg.source not in ("target", "dataset")):
        raise ConfigError(f"method={key} reads the frozen target's hidden states on fixed data: "
                          f"it needs distill.teacher=live or precomputed (got {dist.teacher}) "
                          f"and distill.data.source=target or dataset (got {data_cfg.source})")
    if dist.teacher == "precomputed" and (not method.precomputed or data_cfg.source != "target"):
        raise ConfigError(f"distill.teacher=precomputed reads the features stage's store, made for EAGLE heads "
                          f"(method={'/'.join(n for n in methods.names('train') if methods.find(n).precomputed)}) "
                          f"on the generate stage's answers (distill.data.source=target); "
                          f"got method={key}, source={data_cfg.source}: use distill.teacher=live")
    if dist.teacher == "stored" and data_cfg.source in ("draft", "mix"):
        raise ConfigError(f"distill.data.source={data_cfg.source} trains on the draft's own samples, which have no "
                          "stored top-k: use distill.teacher=live")
    if dist.teacher in ("stored", "precomputed") and loss.needs_full_teacher:
        raise ConfigError(f"methods.{key}.loss={loss_cfg.name} needs the target's full distribution; "
                          f"distill.teacher={dist.teacher} keeps only its top-k: "
                          f"use distill.teacher=live or loss fkl / topk_kl")


def data_for(c: Checked, target: Any) -> tuple[DistillDataModule, str]:
    """The data module over the generated answers (and the features store, for a precomputed teacher), and the
    stamp of the data it reads: a checkpoint resumes only on the same data."""
    generated = Path(c.cfg["paths"]["generated_dir"])
    data_stamp = (generated / "FINGERPRINT").read_text().strip() if (generated / "FINGERPRINT").exists() else "none"
    features_dir = None
    if c.distill.teacher == "precomputed":  # the store must fit this run: same data, target, spans and layers
        features_dir = Path(c.cfg["paths"].get("features_dir", "data/features"))
        layers = c.mcfg.layers(target.model.config.num_hidden_layers)
        try:
            store = check_store(features_dir, layers, c.data.max_length, data_stamp, target.fingerprint)
        except DataError as e:
            raise ConfigError(str(e)) from e
        data_stamp = f"{data_stamp}+features:{store['fingerprint']}"  # a new store (other k, dtype) starts afresh
    pad_id = target.pad_id
    datamodule = DistillDataModule(c.data, generated, c.cfg["paths"]["prompts_dir"], tokenizer=target.tokenizer,
                                   pad_id=pad_id, features_dir=features_dir)
    datamodule.setup("fit")
    return datamodule, data_stamp


def lightning_trainer(c: Checked, cfg: dict[str, Any], stamp: str) -> tuple[Any, Any, str | None]:
    """The Trainer (checkpoints under the run's fingerprint, W&B, a tqdm bar), its logger, and the checkpoint an
    interrupted run of the same configuration resumes from."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt_path, run_id = resume_point(c.plan.ckpt_dir, stamp)
    if ckpt_path:
        log.info("resuming from %s", ckpt_path)
    run_id = run_id or f"{stamp[:8]}-{os.urandom(3).hex()}"  # a resumed stage continues its W&B run
    logger = lightning_logger(cfg.get("logger"), run_id, c.plan.run_name, cfg.get("experiment_name", "default"), cfg)
    # after every validation pass, so a checkpoint holds the acceptance curve up to its step
    checkpoint = ModelCheckpoint(dirpath=c.plan.ckpt_dir, filename="step{step}", save_last="link", save_top_k=1,
                                 save_on_train_epoch_end=False, auto_insert_metric_name=False)
    # tqdm, as the other stages: Lightning's default with `rich` installed draws nothing into a log file
    # (`nohup dvc repro > log`), so an hour of training would show no progress there
    bar = [TQDMProgressBar()] if c.trainer.get("enable_progress_bar", True) else []
    try:
        trainer = pl.Trainer(**c.trainer, logger=logger, use_distributed_sampler=False,
                             callbacks=[CheckpointDir(c.plan.ckpt_dir, stamp, run_id), checkpoint, Throughput(), *bar],
                             default_root_dir=str(c.plan.ckpt_dir))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"trainer: {e}") from e
    return trainer, logger, ckpt_path


def record(c: Checked, cfg: dict[str, Any], final: dict[str, float], steps: int, target: Any, datamodule: Any,
           built: Any) -> dict[str, Any]:
    """The run's record: the final validation figures and every setting that shaped it."""
    module = built.module
    settings = {"method": asdict(c.mcfg), "draft": asdict(c.size) if c.size else None, "loss": asdict(c.loss_cfg),
                "distill": cfg["distill"], "trainer": c.trainer, "experiment": cfg.get("experiment_name", "default"),
                "target_fingerprint": target.fingerprint, "target_dtype": str(target.dtype).removeprefix("torch."),
                "train_tokens": datamodule.num_train_tokens,
                "val_tokens": datamodule.num_val_tokens,
                "draft_parameters": sum(p.numel() for p in built.student.parameters()),
                "draft_vocab": None if module.d2t is None else len(module.d2t), **environment()}
    result = {"method": c.method.name, "final": final, "steps": steps, "settings": settings}
    code_fraction = (cfg.get("data") or {}).get("code_fraction")
    if code_fraction is not None:  # only then, so a run on the source's own mix keeps its settings as they were
        settings["prompt_mix"] = {"code_fraction": code_fraction}
    if c.mcfg.init_from:  # only then: a run from scratch keeps its settings as they were
        settings["lineage"] = lineage(c.mcfg.init_from)
    if built.record is not None:  # the method's own fields (Medusa: its trees)
        result.update(built.record())
    return result


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
    return Plan(Path(paths.get("models_dir", "models")) / method,
                Path(paths.get("checkpoints_dir", "checkpoints")) / method,
                Path(paths.get("metrics_dir", "metrics")) / f"train_{method}.json",
                Path(paths.get("plots_dir", "plots")) / f"train_{method}", name)
