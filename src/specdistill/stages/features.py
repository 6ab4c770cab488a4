"""features: the frozen target's hidden states and top-k once per training sequence, for EAGLE training
with `distill.teacher=precomputed` (data/features.py says what a shard holds). Resumable by shard."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdistill.data.datamodule import DataConfig, DataError, kept_spans, load_split
from specdistill.data.features import (
    DTYPES,
    MANIFEST,
    FeaturesConfig,
    compute_features,
    store_fingerprint,
    write_shard,
)
from specdistill.data.generation import prepare_output
from specdistill.io import write_json
from specdistill.models.eagle import default_feature_layers
from specdistill.models.target import TargetConfig, load_target
from specdistill.stages.common import check_outputs, environment, section

log = logging.getLogger(__name__)


def default_layers(num_layers: int) -> list[int]:
    """What method=eagle and method=eagle1 read by default, so one store serves both."""
    return sorted(set(default_feature_layers("eagle3", num_layers)) | set(default_feature_layers("eagle1", num_layers)))


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    fcfg = section(FeaturesConfig, dict(cfg["features"]), "features")
    dcfg = section(DataConfig, dict(cfg["distill"]["data"]), "distill.data")
    tcfg = section(TargetConfig, dict(cfg["target"]), "target")
    generated, out = Path(cfg["paths"]["generated_dir"]), Path(cfg["paths"]["features_dir"])
    check_outputs(cfg, locked={"paths.features_dir": out})
    stamp = generated / "FINGERPRINT"
    if not stamp.exists():
        raise DataError(f"no generated data at {generated}: run the generate stage first (dvc repro generate)")
    shards = {s: sorted(p for p in (generated / s).glob("shard-*") if p.is_dir()) for s in fcfg.splits}
    for split, found in shards.items():
        if not found:
            raise DataError(f"no generated shards in {generated / split}: list generated splits in features.splits")

    target = load_target(tcfg)
    layers = fcfg.layers or default_layers(target.model.config.num_hidden_layers)
    fingerprint = store_fingerprint(layers, fcfg.topk, fcfg.dtype, dcfg.max_length, target.fingerprint,
                                    stamp.read_text().strip())
    prepare_output(out, fingerprint)  # keeps whole shards of the same fingerprint: a killed stage resumes
    todo = [(s, p) for s, found in shards.items() for p in found if not (out / s / f"{p.name}.safetensors").exists()]
    log.info("%d shard(s), %d already whole, %d to compute", sum(map(len, shards.values())),
             sum(map(len, shards.values())) - len(todo), len(todo))
    pad_id = target.tokenizer.pad_token_id or 0
    t0, tokens = time.perf_counter(), 0
    for split, shard in todo:
        ds = load_split(shard)
        if ds is None:
            continue
        keep, pk, rk = kept_spans(ds, dcfg.max_length, str(shard))  # the rows and spans the data module batches
        seqs, rids, full_p = ds["input_ids"], ds["id"], ds["prompt_len"]  # each column read once
        if len(set(rids)) != len(ds):
            raise DataError(f"{shard}: row ids repeat; the store finds rows by id")
        order = sorted(range(len(keep)), key=lambda j: int(pk[j] + rk[j]))  # j: a kept row; keep[j] its index
        parts: dict[int, Any] = {}
        bar = tqdm(total=len(order), unit="seq", desc=f"features {split}/{shard.name}", dynamic_ncols=True)
        for b in range(0, len(order), fcfg.batch_size):
            batch = order[b:b + fcfg.batch_size]
            spans = [(int(keep[j]), int(pk[j]), int(rk[j])) for j in batch]
            rows = [(seqs[i][full_p[i] - p:full_p[i] + r], p, r) for i, p, r in spans]
            for j, part in zip(batch, compute_features(target.model, rows, layers, fcfg.topk, DTYPES[fcfg.dtype], pad_id),
                               strict=True):
                parts[j] = part
            tokens += sum(len(s) for s, _, _ in rows)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
        bar.close()
        write_shard(out / split / f"{shard.name}.safetensors", [rids[i] for i in keep], pk.tolist(), rk.tolist(),
                    [parts[j] for j in range(len(keep))])
    elapsed = time.perf_counter() - t0
    manifest = {"fingerprint": fingerprint, "layers": layers, "topk": fcfg.topk, "dtype": fcfg.dtype,
                "max_length": dcfg.max_length, "target_fingerprint": target.fingerprint,
                "generated_fingerprint": stamp.read_text().strip(), "hidden_size": target.model.config.hidden_size,
                "splits": {s: [p.name for p in found] for s, found in shards.items()}, "environment": environment()}
    write_json(out / MANIFEST, manifest)
    log.info("features of %d tokens in %.1f s -> %s", tokens, elapsed, out)
    return {**manifest, "this_run": {"shards": len(todo), "tokens": tokens, "seconds": round(elapsed, 2)}}
