"""features: the frozen target's hidden states and top-k once per training sequence, for EAGLE training
with `distill.teacher=precomputed` (core/data/features.py says what a shard holds). Resumable by shard.

`features.engine=own` runs the target here (HiddenTap, as the live path); `features.engine=vllm` has the serving
engine compute the same rows (engine/features.py) into the same store, its name and version in the fingerprint."""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdistill.core.config import section
from specdistill.core.data.datamodule import DataConfig, DataError, kept_spans, load_split
from specdistill.core.data.features import (
    DTYPES,
    MANIFEST,
    FeaturesConfig,
    compute_features,
    store_fingerprint,
    write_shard,
)
from specdistill.core.data.generation import prepare_output
from specdistill.core.hardware import environment
from specdistill.core.io import write_json
from specdistill.core.models.hidden import store_layers
from specdistill.core.models.target import (
    TargetConfig,
    context_length,
    load_target,
    load_target_config,
    target_fingerprint,
)
from specdistill.core.stage import check_outputs
from specdistill.core.tracking import wandb_run
from specdistill.engine.client import engine_version

log = logging.getLogger(__name__)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    feat_cfg = section(FeaturesConfig, dict(cfg["features"]), "features")
    data_cfg = section(DataConfig, dict(cfg["distill"]["data"]), "distill.data")
    target_cfg = section(TargetConfig, dict(cfg["target"]), "target")
    if feat_cfg.dtype == "auto":  # the target's resolved dtype: EAGLE then trains on the states it drafts from
        feat_cfg = replace(feat_cfg, dtype=target_cfg.dtype)
    generated, out = Path(cfg["paths"]["generated_dir"]), Path(cfg["paths"]["features_dir"])
    check_outputs(cfg, locked={"paths.features_dir": out})
    stamp = generated / "FINGERPRINT"
    if not stamp.exists():
        raise DataError(f"no generated data at {generated}: run the generate stage first (dvc repro generate)")
    shards = {s: sorted(p for p in (generated / s).glob("shard-*") if p.is_dir()) for s in feat_cfg.splits}
    for split, found in shards.items():
        if not found:
            raise DataError(f"no generated shards in {generated / split}: list generated splits in features.splits")

    engine = engine_version() if feat_cfg.engine == "vllm" else None  # no engine environment: an error now
    # the engine loads an HF target in its own process; a GGUF target is loaded here to be exported for it
    target = load_target(target_cfg) if feat_cfg.engine == "own" or target_cfg.gguf_file else None
    config = target.config if target else load_target_config(target_cfg)
    target_fp = target.fingerprint if target else target_fingerprint(target_cfg)
    layers = feat_cfg.layers or store_layers(config.num_hidden_layers)
    fingerprint = store_fingerprint(layers, feat_cfg.topk, feat_cfg.dtype, data_cfg.max_length, target_fp,
                                    stamp.read_text().strip(), engine)
    prepare_output(out, fingerprint)  # keeps whole shards of the same fingerprint: a killed stage resumes
    todo = [(s, p) for s, found in shards.items() for p in found if not (out / s / f"{p.name}.safetensors").exists()]
    log.info("%d shard(s), %d already whole, %d to compute%s", sum(map(len, shards.values())),
             sum(map(len, shards.values())) - len(todo), len(todo),
             f" with {engine} ({feat_cfg.engine_workers} worker(s))" if engine else "")
    t0, tokens = time.perf_counter(), 0
    engine_run = None
    if engine:
        engine_run, tokens = features_from_engine(feat_cfg, target_cfg, target, config, layers, data_cfg.max_length,
                                                  todo, out)
    for split, shard in todo if not engine else []:
        rows_of = shard_rows(shard, data_cfg.max_length)
        if rows_of is None:
            continue
        rids, keep, pk, rk, seqs, full_p = rows_of
        order = sorted(range(len(keep)), key=lambda j: int(pk[j] + rk[j]))  # j: a kept row; keep[j] its index
        parts: dict[int, Any] = {}
        bar = tqdm(total=len(order), unit="seq", desc=f"features {split}/{shard.name}", dynamic_ncols=True)
        for b in range(0, len(order), feat_cfg.batch_size):
            batch = order[b:b + feat_cfg.batch_size]
            spans = [(int(keep[j]), int(pk[j]), int(rk[j])) for j in batch]
            rows = [(seqs[i][full_p[i] - p:full_p[i] + r], p, r) for i, p, r in spans]
            for j, part in zip(batch, compute_features(target.model, rows, layers, feat_cfg.topk,
                                                       DTYPES[feat_cfg.dtype],
                                                       target.pad_id), strict=True):
                parts[j] = part
            tokens += sum(len(s) for s, _, _ in rows)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
        bar.close()
        write_shard(out / split / f"{shard.name}.safetensors", [rids[i] for i in keep], pk.tolist(), rk.tolist(),
                    [parts[j] for j in range(len(keep))])
    elapsed = time.perf_counter() - t0
    manifest = {"fingerprint": fingerprint, "layers": layers, "topk": feat_cfg.topk, "dtype": feat_cfg.dtype,
                "max_length": data_cfg.max_length, "target_fingerprint": target_fp,
                "generated_fingerprint": stamp.read_text().strip(), "hidden_size": config.hidden_size,
                **({"engine": engine} if engine else {}),
                "splits": {s: [p.name for p in found] for s, found in shards.items()}, "environment": environment()}
    write_json(out / MANIFEST, manifest)
    log.info("features of %d tokens in %.1f s -> %s", tokens, elapsed, out)
    this_run = {"shards": len(todo), "tokens": tokens, "seconds": round(elapsed, 2)}
    if engine_run is not None:
        this_run["engine"] = {"name": engine, **engine_run}
    with wandb_run(cfg.get("logger"), job_type="features", group=cfg.get("experiment_name", "default"),
                   config=cfg) as run_:
        run_.summary.update({f"features/{k}": v for k, v in this_run.items() if isinstance(v, int | float)})
    return {**manifest, "this_run": this_run}


def shard_rows(shard: Path, max_length: int) -> tuple[list[str], Any, Any, Any, Any, Any] | None:
    """(row ids, kept row indices, kept prompt / response spans, input_ids, prompt_len) of a generated shard, or
    None when it is empty: the rows and spans the data module batches."""
    ds = load_split(shard)
    if ds is None:
        return None
    keep, pk, rk = kept_spans(ds, max_length, str(shard))
    seqs, rids, full_p = ds["input_ids"], ds["id"], ds["prompt_len"]  # each column read once
    if len(set(rids)) != len(ds):
        raise DataError(f"{shard}: row ids repeat; the store finds rows by id")
    return rids, keep, pk, rk, seqs, full_p


def features_from_engine(feat_cfg: FeaturesConfig, target_cfg: TargetConfig, target: Any, config: Any,
                         layers: list[int],
                         max_length: int, todo: list[tuple[str, Path]], out: Path) -> tuple[dict[str, Any], int]:
    """The shards in `todo` computed by the serving engine (features.engine=vllm), each written with `write_shard`
    as the own pass writes it; (what the engine's workers report, tokens run)."""
    from specdistill.engine.features import describe, features_with_engine, job_for

    meta: dict[str, tuple[list[str], list[int], list[int]]] = {}
    shards = []
    for split, shard in todo:
        rows_of = shard_rows(shard, max_length)
        if rows_of is None:
            continue
        rids, keep, pk, rk, seqs, full_p = rows_of
        key = f"{split}/{shard.name}"
        rows = [[seqs[i][full_p[i] - p:full_p[i] + r], p, r] for i, p, r in zip(keep.tolist(), pk.tolist(), rk.tolist(),
                                                                               strict=True)]
        meta[key] = ([rids[i] for i in keep], pk.tolist(), rk.tolist())
        shards.append({"key": key, "rows": rows})
    if not shards:
        return {"workers": 0}, 0
    tokens = 0
    bar = tqdm(total=len(shards), unit="shard", desc="features (engine)", dynamic_ncols=True)
    t0 = time.perf_counter()

    def on_shard(key: str, part: tuple[Any, Any, Any], seconds: float) -> None:
        nonlocal tokens
        ids, pk, rk = meta[key]
        feats, topk_ids, topk_lp = part
        write_shard(out / f"{key}.safetensors", ids, pk, rk, [(feats.to(DTYPES[feat_cfg.dtype]), topk_ids, topk_lp)])
        tokens += sum(pk) + sum(rk)
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f}")

    topk = min(feat_cfg.topk, int(config.vocab_size))  # as the own pass's topk over the vocabulary
    longest = max(len(r[0]) for s in shards for r in s["rows"])
    with tempfile.TemporaryDirectory(prefix="specdistill-target-") as tmp:
        if target is not None:  # a GGUF target: the engine reads the HF folder written from its dequantised weights
            from specdistill.export.target import export_target

            model_dir = export_target(target.model, target.tokenizer, Path(tmp) / "target", target.fingerprint,
                                      target.dtype)
            revision = None
        else:
            model_dir, revision = Path(target_cfg.name_or_path), target_cfg.revision
        job = job_for(model_dir, revision=revision, dtype=target_cfg.dtype, longest=longest,
                      context=context_length(config),
                      batch_size=feat_cfg.batch_size)
        results = features_with_engine(job, shards, layers=layers, topk=topk, workers=feat_cfg.engine_workers,
                                       device=feat_cfg.engine_device, timeout_s=feat_cfg.engine_timeout_s,
                                       on_shard=on_shard)
    bar.close()
    return describe(results), tokens
