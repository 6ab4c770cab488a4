"""generate: the target answers the train / val prompts (on-policy data), in resumable shards.

`data/generated` holds what decides later stages (the shards and a manifest of config, fingerprint and
counts) and nothing that varies between identical runs, so a rerun that writes the same tokens keeps the
same DVC hash and leaves every later stage up to date. How fast it went (tokens/s per shard, the machine)
goes to `metrics/generate.json`, updated after each shard so a killed run's timing survives with its shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import datasets
from tqdm.auto import tqdm

from specdistill.data.generation import (
    GenerateConfig,
    GenerationError,
    count_tokens,
    generate_shard,
    pop_legacy_stats,
    prepare_output,
    shard_name,
    write_shard,
)
from specdistill.io import write_json
from specdistill.models.target import TargetConfig, context_length, load_target
from specdistill.stages.common import check_outputs, environment, section
from specdistill.tracking import wandb_run

log = logging.getLogger(__name__)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    gcfg = section(GenerateConfig, dict(cfg["generate"]), "generate")
    tcfg = section(TargetConfig, dict(cfg["target"]), "target")
    prompts_dir, out = Path(cfg["paths"]["prompts_dir"]), Path(cfg["paths"]["generated_dir"])
    timing_file = Path(cfg["paths"]["metrics_dir"]) / "generate.json"
    check_outputs(cfg, fingerprinted={"paths.generated_dir": out}, files={"paths.metrics_dir": timing_file})
    splits = {}
    for split in gcfg.splits:
        if not (prompts_dir / split).exists():
            raise GenerationError(f"prompt split {prompts_dir / split} is missing: run the prepare stage first")
        splits[split] = datasets.load_from_disk(str(prompts_dir / split))
        if len(splits[split]) == 0:
            raise GenerationError(f"prompt split {split} is empty: check the data config")

    target = load_target(tcfg)
    check_context(splits, gcfg.max_new_tokens, context_length(target.config))  # before any shard is touched
    fingerprint = gcfg.fingerprint({"target": target.fingerprint, "dtype": tcfg.dtype,
                                    "prompts": {s: content_hash(d) for s, d in splits.items()}})
    prepare_output(out, fingerprint)
    plan = [(s, i, range(i * gcfg.shard_size, min((i + 1) * gcfg.shard_size, len(d))))
            for s, d in splits.items() for i in range((len(d) + gcfg.shard_size - 1) // gcfg.shard_size)]
    todo = [p for p in plan if not (out / p[0] / shard_name(p[1])).exists()]
    timing, env = kept_timing(timing_file, fingerprint, out, plan), environment()  # env: once, not per shard
    log.info("%d shard(s) planned, %d already whole, %d to generate", len(plan), len(plan) - len(todo), len(todo))

    group = cfg.get("experiment_name", "default")
    with wandb_run(cfg.get("logger"), job_type="generate", group=group, config=cfg) as run_:
        t0, new_tokens = time.perf_counter(), 0
        bar = tqdm(total=sum(len(r) for _, _, r in todo), unit="prompt", desc="generate", dynamic_ncols=True)

        def on_tokens(n_prompts: int, n_tokens: int) -> None:
            nonlocal new_tokens
            new_tokens += n_tokens
            rate = new_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.update(n_prompts)
            bar.set_postfix(tok_s=f"{rate:.0f}", tokens=new_tokens)
            run_.log({"generate/tokens": new_tokens, "generate/tokens_per_s": rate})

        for split, idx, rows in todo:
            rows_ = [splits[split][i] for i in rows]
            seed = gcfg.seed * 1_000_003 + idx + (0 if split == "train" else 500_009)
            t_shard, before = time.perf_counter(), new_tokens
            cols = generate_shard(target.model, target.tokenizer, rows_, gcfg, seed, on_tokens)
            write_shard(cols, out / split / shard_name(idx))
            timing[f"{split}/{shard_name(idx)}"] = {"new_tokens": new_tokens - before,
                                                    "seconds": round(time.perf_counter() - t_shard, 3)}
            write_timing(timing_file, fingerprint, timing, plan, env)
        bar.close()
        elapsed = time.perf_counter() - t0

        counts: dict[str, dict[str, int]] = {}
        for split, idx, _ in plan:
            n, p, r = count_tokens(out / split / shard_name(idx))
            c = counts.setdefault(split, {"sequences": 0, "shards": 0, "prompt_tokens": 0, "response_tokens": 0})
            c["sequences"] += n
            c["shards"] += 1
            c["prompt_tokens"] += p
            c["response_tokens"] += r
        manifest = {
            "config": {"generate": vars(gcfg), "target": vars(tcfg)},
            "target_fingerprint": target.fingerprint,
            "fingerprint": fingerprint,
            "counts": counts,
            "columns": ["id", "input_ids", "prompt_len"] + (["topk_ids", "topk_logprobs"] if gcfg.topk_logprobs else []),
            # tokens/s lives there, not here: timing would give identical data a new DVC hash on every rerun
            "timing": str(timing_file),
        }
        write_json(out / "manifest.json", manifest)
        this_run = {"shards": len(todo), "new_tokens": new_tokens, "seconds": round(elapsed, 2)}
        metrics = write_timing(timing_file, fingerprint, timing, plan, env, this_run)
        manifest = {**manifest, "generation": metrics["generation"], "this_run": this_run}
        run_.summary.update({f"generate/{s}_{k}": v for s, c in counts.items() for k, v in c.items()})
    log.info("generated %d new tokens in %.1f s (%.1f tokens/s); totals %s", new_tokens, elapsed,
             new_tokens / max(elapsed, 1e-9), counts)
    return manifest


def check_context(splits: dict[str, Any], max_new_tokens: int, context: int | None) -> None:
    """Every prompt and its longest answer fit in the target's context: past it the positions are ones the
    target never saw, and the data would teach the draft what the target does out of its range."""
    if context is None:
        return
    for split, ds in splits.items():
        longest = max(ds["prompt_tokens"]) if "prompt_tokens" in ds.column_names else 0
        if longest + max_new_tokens > context:
            raise GenerationError(
                f"split {split}: its longest prompt has {longest} tokens, and with generate.max_new_tokens="
                f"{max_new_tokens} an answer would reach {longest + max_new_tokens} positions, past the target's "
                f"context of {context}. Lower data.max_prompt_tokens (and rerun prepare) or generate.max_new_tokens")


def kept_timing(path: Path, fingerprint: str, out: Path, plan: list[tuple[str, int, range]]) -> dict[str, Any]:
    """Timing of the shards this run keeps: from `metrics/generate.json` when it describes this data, or
    moved out of a shard that an older version wrote it into (so the shard then hashes by content)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    timing = dict(old.get("shards", {})) if old.get("fingerprint") == fingerprint else {}
    for split, idx, _ in plan:
        shard = out / split / shard_name(idx)
        legacy = pop_legacy_stats(shard) if shard.exists() else None
        if legacy is not None:
            timing.setdefault(f"{split}/{shard_name(idx)}", legacy)
    return {k: v for k, v in timing.items() if (out / k).exists()}


def write_timing(path: Path, fingerprint: str, timing: dict[str, Any], plan: list[tuple[str, int, range]],
                 env: dict[str, Any], this_run: dict[str, Any] | None = None) -> dict[str, Any]:
    """Totals over every timed shard, whichever run made it: a resumed or a no-op rerun gives the same totals.
    A shard whose run was killed between its rename and this write stays untimed (counted, not guessed)."""
    names = [f"{split}/{shard_name(idx)}" for split, idx, _ in plan]
    timed = [timing[n] for n in names if n in timing]
    tokens, seconds = sum(t.get("new_tokens", 0) for t in timed), round(sum(t.get("seconds", 0.0) for t in timed), 2)
    metrics = {"fingerprint": fingerprint, "environment": env,
               "generation": {"new_tokens": tokens, "seconds": seconds,
                              "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
                              "untimed_shards": len(names) - len(timed)},
               "shards": {n: timing[n] for n in names if n in timing}}
    if this_run is not None:
        metrics["this_run"] = this_run
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, metrics)
    return metrics


def content_hash(ds: datasets.Dataset) -> str:
    """A hash of what the prompts say, so rewriting identical prompts does not invalidate shards."""
    h = hashlib.sha256()
    for rid, prompt in zip(ds["id"], ds["prompt"], strict=True):
        h.update(rid.encode() + b"\0" + prompt.encode() + b"\1")
    return h.hexdigest()[:16]
