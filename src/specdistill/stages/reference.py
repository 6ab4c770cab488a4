"""reference@<key>: vLLM's speculators trains the draft of `methods.<m>` on our data, beside our train@<m>.

The question it answers: would the field's reference trainer do better on the same data? The item's method settings
decide the run (conf/reference/default.yaml): the same training sequences and target states (our train split and
features store, converted once per layer set into speculators' offline format, reference/convert.py), the same draft
vocabulary, seed, learning rate, warm-up and cosine schedule, the same optimizer steps (`methods.<m>.trainer
.max_steps`) and about the same tokens per step (our sequences per step times their mean length, packed). Recipe
`matched` also takes our head's architecture, loss and AdamW; `shipped` keeps speculators' defaults (Muon included).

speculators' trainer runs in the engine's environment (`make engine`), unedited, through reference/launch.py (its CPU
shims, the exact step count, the timing). Writes `models/reference/<key>/` (the last step's checkpoint: speculators
format, which `vllm serve` loads as it is and our evaluator reads through `decode.<m>.path`) and
`metrics/reference_<key>.json` (steps, tokens, seconds, tokens/s, peak memory; the whole record in records/). Its
epoch checkpoints and the converted data stay in `checkpoints/reference/` under fingerprints: a killed run resumes
from its last epoch, a changed one starts afresh.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from specdistill import methods
from specdistill.core.config import section
from specdistill.core.data.datamodule import DataConfig, DataError, DistillDataModule
from specdistill.core.data.features import check_store
from specdistill.core.hardware import environment
from specdistill.core.io import atomic_path, config_hash, sha256_file
from specdistill.core.models.target import TargetConfig, load_tokenizer, stop_ids
from specdistill.core.outputs import check_replaceable
from specdistill.core.records import metrics_files, write_record
from specdistill.core.stage import ConfigError, check_outputs
from specdistill.engine.environment import PROJECT, EngineError, engine_python
from specdistill.export.target import ExportError, exported_fingerprint
from specdistill.reference import ReferenceConfig, item_of, loss_fn
from specdistill.reference.convert import write_offline
from specdistill.stages.train import method_sections

log = logging.getLogger(__name__)

LAUNCH = Path(__file__).resolve().parents[1] / "reference" / "launch.py"
SHIMS = LAUNCH.with_name("shims.py")
KEPT = ("config.json", "model.safetensors")  # what an epoch checkpoint holds that the engine and our reader load


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    ref = section(ReferenceConfig, dict(cfg["reference"]), "reference")
    item = item_of(ref)
    key = ref.method
    paths = cfg["paths"]
    out, metrics_file = Path(ref.dir) / key, Path(paths.get("metrics_dir", "metrics")) / f"reference_{key}.json"
    method, mcfg, _, loss_cfg, distill = method_sections(cfg, item["method"])
    if method.name != item["name"]:
        raise ConfigError(f"reference.items.{key}.name={item['name']}: methods.{item['method']} is a {method.name} "
                          f"(its name), and the item watches that method's code: set name: {method.name}")
    if method.reference is None:
        raise ConfigError(f"reference.items.{key}.method={item['method']}: {method.name} has no reference trainer; "
                          f"use a method of {list(methods.names('reference'))}")
    data_cfg = section(DataConfig, dict(distill["data"]), "distill.data")
    trainer = {**dict(cfg["trainer"]), **(mcfg.trainer or {})}
    steps = int(trainer.get("max_steps", -1))
    if steps < 1:
        raise ConfigError(f"methods.{item['method']}.trainer.max_steps={steps}: the reference runs the same number "
                          "of steps as ours, so it needs a positive step count")
    verifier = Path(ref.verifier)
    if not (verifier / "config.json").exists():
        raise ExportError(f"reference@{key} trains against the exported target, and {verifier} is missing: run "
                          "`dvc repro export_target` first")
    work = Path(ref.work_dir) / key
    check_outputs(cfg, names={"reference.method": key}, replaced={"reference.dir": out},
                  files={"paths.metrics_dir": metrics_files(metrics_file)}, locked={"reference.work_dir": work})
    python = engine_python()  # no engine environment: a clear error now, not after the conversion
    target_cfg = section(TargetConfig, dict(cfg["target"]), "target")
    tokenizer = load_tokenizer(target_cfg)
    stops = stop_ids(None, tokenizer)
    config = json.loads((verifier / "config.json").read_text())
    num_layers, vocab = int(config["num_hidden_layers"]), int(config["vocab_size"])
    where = f"methods.{item['method']}"
    recipe = item["recipe"]
    ctx = methods.ReferenceContext(recipe, num_layers, data_cfg.batch_size, tokenizer, stops,
                                   loss_fn(loss_cfg.name, where) if recipe == "matched" else "")
    own = method.reference(mcfg, ctx)

    data, rows, tokens, dtype = converted(cfg, ref, data_cfg, own.aux, num_layers, vocab,
                                          getattr(mcfg, "vocab_size", None), stops, verifier)
    tokens_per_step = max(1, round(data_cfg.batch_size * tokens / rows))  # our sequences per step, packed
    opt = dict(distill["optimizer"])
    scheduler = distill.get("scheduler") or {}
    argv = ["--verifier-name-or-path", str(verifier), "--data-path", str(data), "--save-path", str(work / "run"),
            "--total-seq-len", str(tokens_per_step), "--seed", str(int(cfg.get("seed", 0))),
            "--hidden-states-dtype", dtype,
            "--loss-implementation", ref.loss_implementation, "--draft-attn-impl", ref.attn_impl,
            "--num-workers", "0", "--logger", "", "--log-dir", str(work / "logs"), "--checkpoint-freq", "1",
            *(["--draft-vocab-size", str(mcfg.vocab_size), "--d2t-path", str(data / "d2t.npy"),
               "--t2d-path", str(data / "t2d.npy")] if getattr(mcfg, "vocab_size", None) else []),
            *own.args]
    if recipe == "matched":  # our optimizer and schedule (conf/optimizer/adamw.yaml, distill.scheduler)
        argv += ["--optimizer", "adamw", "--lr", repr(float(opt.get("lr", 1e-3))),
                 "--weight-decay", repr(float(opt.get("weight_decay", 0.0)))]
        if scheduler:
            argv += ["--scheduler-type", "cosine", "--scheduler-warmup-steps",
                     str(int(scheduler.get("num_warmup_steps", 0))), "--scheduler-total-steps", str(steps)]
    argv += list(ref.extra_args)
    # what decides the run: its arguments, the data, the verifier, the launcher and shims, speculators' pin
    stamp = config_hash({"argv": argv, "steps": steps, "data": (data / "meta.json").read_text(),
                         "verifier": exported_fingerprint(verifier), "code": [sha256_file(LAUNCH), sha256_file(SHIMS)],
                         "engine": sha256_file(PROJECT / "requirements-engine.txt")})
    resumable(work, stamp)
    record_file = work / "launch.json"  # written when a run has finished: a rerun of the same one reads it
    if not record_file.exists():
        log.info("reference@%s: speculators trains %s (%s) for %d steps of ~%d tokens", key, item["method"], recipe,
                 steps, tokens_per_step)
        launch(python, [str(LAUNCH), "--steps", str(steps), "--train-ratio", repr(train_ratio(data)),
                        "--record", str(record_file), "--", *argv], key, ref.timeout_s)
    else:
        log.info("reference@%s: this configuration's run finished before (%s): its checkpoint serves", key, work)
    launched = json.loads(record_file.read_text())
    with atomic_path(out, is_dir=True) as tmp:
        for name in KEPT:
            shutil.copy2(Path(launched["checkpoint"]) / name, tmp / name)
    result = {"method": method.name, "item": key, "recipe": recipe,
              "run": {k: launched.get(k) for k in ("steps", "epochs", "tokens", "wall_s", "train_s", "tokens_per_s",
                                                   "peak_rss_mib", "resumed")},
              "settings": {"methods_key": item["method"], "speculators": launched["speculators"],
                           "engine_torch": launched["torch"], "argv": launched["argv"], "tokens_per_step":
                           tokens_per_step, "rows": rows, **environment()}}
    write_record(metrics_file, result, {k: result["run"][k] for k in ("tokens_per_s", "peak_rss_mib")})
    log.info("reference@%s: %d steps, %.0f tokens/s, peak %.0f MiB -> %s", key, launched["steps"],
             launched["tokens_per_s"] or 0, launched["peak_rss_mib"], out)
    return result


def launch(python: Path, args: list[str], key: str, timeout_s: int) -> None:
    """speculators' trainer through launch.py, its log on our stderr (progress bars as its own)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run([str(python), *args], env=env, timeout=timeout_s, stdout=sys.stderr)
    except subprocess.TimeoutExpired as e:
        raise EngineError(f"reference@{key}: speculators' trainer ran past reference.timeout_s={timeout_s} s; rerun "
                          "to resume from its last epoch, or raise the timeout") from e
    if done.returncode != 0:
        raise EngineError(f"reference@{key}: speculators' trainer failed (exit {done.returncode}); its log is above. "
                          f"The command: {python} {' '.join(args)}")


def train_ratio(data: Path) -> float:
    return float(json.loads((data / "meta.json").read_text())["train_ratio"])


def converted(cfg: dict[str, Any], ref: ReferenceConfig, data_cfg: DataConfig, aux: list[int], num_layers: int,
              vocab: int, draft_vocab: int | None, stops: set[int], verifier: Path) -> tuple[Path, int, int, str]:
    """(folder, rows, tokens, the store's dtype, which is speculators' hidden-states dtype) of our train split in
    speculators' format for these layers, converted once: items that read the same layers and vocabulary share it
    (`work_dir/data-<fingerprint>`)."""
    from specdistill.core.models.vocab import draft_vocabulary

    paths = cfg["paths"]
    generated, features = Path(paths["generated_dir"]), Path(paths.get("features_dir", "data/features"))
    stamp_file = generated / "FINGERPRINT"
    data_stamp = stamp_file.read_text().strip() if stamp_file.exists() else "none"
    try:
        store = check_store(features, [*aux, num_layers], data_cfg.max_length, data_stamp,
                            exported_fingerprint(verifier) or "")
    except DataError as e:
        raise ConfigError(str(e)) from e
    folder = data_folder(Path(ref.work_dir), store["fingerprint"], aux, data_cfg, draft_vocab, stops)
    if (folder / "meta.json").exists():
        meta = json.loads((folder / "meta.json").read_text())
        log.info("reference: the converted data at %s serves this run", folder)
        return folder, int(meta["rows"]), int(meta["tokens"]), str(store["dtype"])
    module = DistillDataModule(data_cfg, generated, paths["prompts_dir"], features_dir=features)
    module.setup("fit")
    d2t = (draft_vocabulary(module.response_tokens("train"), draft_vocab, vocab, always=sorted(stops))
           if draft_vocab else None)
    made = write_offline(module.splits["train"], list(store["layers"]), aux, num_layers, d2t, vocab, folder)
    return folder, made.rows, made.tokens, str(store["dtype"])


def data_folder(work_dir: Path, store: str, aux: list[int], data_cfg: DataConfig, draft_vocab: int | None,
                stops: set[int]) -> Path:
    """Where a conversion lives: named by all that decides its content. The store's fingerprint covers the
    generated data and max_length (check_store refuses another); a data curve's smaller sizes
    (distill.data.train_fraction < 1) add their fraction, so no size reads another's rows, while the whole data
    keeps the name it always had (a finished reference run stays valid)."""
    key: dict[str, Any] = {"store": store, "aux": aux, "vocab": draft_vocab, "stops": sorted(stops)}
    if data_cfg.train_fraction < 1:
        key["train_fraction"] = float(data_cfg.train_fraction)
    return work_dir / ("data-" + config_hash(key)[:12])


def resumable(work: Path, stamp: str) -> None:
    """`work` holds speculators' checkpoints of this configuration only: kept when its FINGERPRINT is `stamp`
    (speculators resumes from its last epoch), replaced when it is another (never a folder without one)."""
    fingerprint = work / "FINGERPRINT"
    if work.exists() and (not fingerprint.exists() or fingerprint.read_text().strip() != stamp):
        if fingerprint.exists():
            log.info("reference: %s holds another configuration's run: starting afresh", work)
        shutil.rmtree(check_replaceable(work, "reference.work_dir", ("FINGERPRINT",)))
    work.mkdir(parents=True, exist_ok=True)
    fingerprint.write_text(stamp + "\n")
