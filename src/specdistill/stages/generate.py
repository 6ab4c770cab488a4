"""generate: the target answers the train / val prompts (on-policy data), in resumable shards.

`data/generated` holds what decides later stages (the shards and a manifest of config, fingerprint and
counts) and nothing that varies between identical runs, so a rerun that writes the same tokens keeps the
same DVC hash and leaves every later stage up to date. How fast it went (tokens/s per shard, the machine)
goes to `metrics/generate.json`, updated after each shard so a killed run's timing survives with its shards.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
from tqdm.auto import tqdm

from specdistill.core.config import section
from specdistill.core.data.generation import (
    GenerateConfig,
    GenerationError,
    count_tokens,
    generate_shard,
    pop_legacy_stats,
    prepare_output,
    shard_columns,
    shard_name,
    tokenise_prompts,
    write_shard,
)
from specdistill.core.hardware import environment
from specdistill.core.io import write_json
from specdistill.core.models.target import (
    TargetConfig,
    context_length,
    load_target,
    load_target_config,
    load_tokenizer,
    stop_ids,
    target_fingerprint,
)
from specdistill.core.records import metrics_files, read_record, write_record
from specdistill.core.stage import check_outputs
from specdistill.core.tracking import wandb_run
from specdistill.engine.client import engine_version
from specdistill.engine.generation import generate_with_engine
from specdistill.export.target import export_target

log = logging.getLogger(__name__)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    gen_cfg = section(GenerateConfig, dict(cfg["generate"]), "generate")
    target_cfg = section(TargetConfig, dict(cfg["target"]), "target")
    prompts_dir, out = Path(cfg["paths"]["prompts_dir"]), Path(cfg["paths"]["generated_dir"])
    timing_file = Path(cfg["paths"]["metrics_dir"]) / "generate.json"
    check_outputs(cfg, fingerprinted={"paths.generated_dir": out},
                  files={"paths.metrics_dir": metrics_files(timing_file)})
    splits = {}
    for split in gen_cfg.splits:
        if not (prompts_dir / split).exists():
            raise GenerationError(f"prompt split {prompts_dir / split} is missing: run the prepare stage first")
        splits[split] = datasets.load_from_disk(str(prompts_dir / split))
        if len(splits[split]) == 0:
            raise GenerationError(f"prompt split {split} is empty: check the data config")

    engine = engine_version() if gen_cfg.engine == "vllm" else None  # no engine environment: an error now
    # the engine loads an HF target in its own process; a GGUF target is loaded here to be exported for it
    target = load_target(target_cfg) if gen_cfg.engine == "own" or target_cfg.gguf_file else None
    tokenizer = target.tokenizer if target else load_tokenizer(target_cfg)
    config = target.config if target else load_target_config(target_cfg)
    target_fp = target.fingerprint if target else target_fingerprint(target_cfg)
    check_context(splits, gen_cfg.max_new_tokens, context_length(config))  # before any shard is touched
    fingerprint = gen_cfg.fingerprint({"target": target_fp, "dtype": target_cfg.dtype,
                                    "prompts": {s: content_hash(d) for s, d in splits.items()},
                                    **({"engine": engine} if engine else {})})
    prepare_output(out, fingerprint)
    plan = [(s, i, range(i * gen_cfg.shard_size, min((i + 1) * gen_cfg.shard_size, len(d))))
            for s, d in splits.items() for i in range((len(d) + gen_cfg.shard_size - 1) // gen_cfg.shard_size)]
    todo = [p for p in plan if not (out / p[0] / shard_name(p[1])).exists()]
    # env: once, not per shard; with the dtype the target answers in (auto resolved for this machine)
    timing, env = kept_timing(timing_file, fingerprint, out, plan), {**environment(), "dtype": target_cfg.dtype}
    log.info("%d shard(s) planned, %d already whole, %d to generate%s", len(plan), len(plan) - len(todo), len(todo),
             f" with {engine} ({gen_cfg.engine_workers} worker(s))" if engine else "")

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

        def shard_done(key: str, cols: dict[str, list[Any]], seconds: float) -> None:
            """A whole shard under its final name, then its timing (a kill between the two leaves it untimed)."""
            write_shard(cols, out / key)
            timing[key] = {"new_tokens": sum(len(x) for x in cols["input_ids"]) - sum(cols["prompt_len"]),
                           "seconds": round(seconds, 3)}
            write_timing(timing_file, fingerprint, timing, plan, env)

        workers = None
        if engine:
            workers = answer_with_engine(gen_cfg, target_cfg, target, tokenizer, splits, todo, on_tokens, shard_done)
        for split, idx, rows in todo if not engine else []:
            t_shard = time.perf_counter()
            cols = generate_shard(target.model, tokenizer, [splits[split][i] for i in rows], gen_cfg,
                                  shard_seed(gen_cfg, split, idx), on_tokens)
            shard_done(f"{split}/{shard_name(idx)}", cols, time.perf_counter() - t_shard)
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
            "config": {"generate": {k: v for k, v in vars(gen_cfg).items() if k == "splits" or k not in gen_cfg.HOW},
                       "target": vars(target_cfg)},
            **({"engine": engine} if engine else {}),
            "target_fingerprint": target_fp,
            "fingerprint": fingerprint,
            "counts": counts,
            "columns": ["id", "input_ids", "prompt_len"]
                       + (["topk_ids", "topk_logprobs"] if gen_cfg.topk_logprobs else []),
            # tokens/s lives there, not here: timing would give identical data a new DVC hash on every rerun
            "timing": str(timing_file),
        }
        write_json(out / "manifest.json", manifest)
        this_run = {"shards": len(todo), "new_tokens": new_tokens, "seconds": round(elapsed, 2)}
        if workers is not None:
            this_run["engine"] = {"name": engine, "workers": len(workers),
                                  "cold_start_s": [round(w["cold_start_s"], 1) for w in workers]}
        metrics = write_timing(timing_file, fingerprint, timing, plan, env, this_run)
        manifest = {**manifest, "generation": metrics["generation"], "this_run": this_run}
        run_.summary.update({f"generate/{s}_{k}": v for s, c in counts.items() for k, v in c.items()})
    log.info("generated %d new tokens in %.1f s (%.1f tokens/s); totals %s", new_tokens, elapsed,
             new_tokens / max(elapsed, 1e-9), counts)
    return manifest


def shard_seed(gen_cfg: GenerateConfig, split: str, idx: int) -> int:
    """Each shard's own seed, so a resumed run samples a shard as a whole run would."""
    return gen_cfg.seed * 1_000_003 + idx + (0 if split == "train" else 500_009)


def answer_with_engine(gen_cfg: GenerateConfig, target_cfg: TargetConfig, target: Any, tokenizer: Any,
                       splits: dict[str, Any],
                       todo: list[tuple[str, int, range]], on_tokens: Callable[[int, int], None],
                       shard_done: Callable[[str, dict[str, list[Any]], float], None]) -> list[dict[str, Any]]:
    """The shards in `todo` answered by the serving engine (generate.engine=vllm), each handed to `shard_done` as the
    own loop's are; the engine's workers' results (cold starts, versions)."""
    todo_rows = {f"{split}/{shard_name(idx)}": [splits[split][i] for i in rows] for split, idx, rows in todo}
    prompts = {key: tokenise_prompts(tokenizer, rows) for key, rows in todo_rows.items()}
    shards = [{"key": f"{split}/{shard_name(idx)}", "prompts": prompts[f"{split}/{shard_name(idx)}"],
               "seed": shard_seed(gen_cfg, split, idx)} for split, idx, _ in todo]
    longest = max((len(p) for ps in prompts.values() for p in ps), default=0)

    def on_shard(key: str, rows: list[dict[str, Any]], seconds: float) -> None:
        responses = [r["response"] for r in rows]
        topk = ([r["topk_ids"] for r in rows], [r["topk_logprobs"] for r in rows]) if gen_cfg.topk_logprobs else None
        shard_done(key, shard_columns(todo_rows[key], prompts[key], responses, topk), seconds)
        on_tokens(len(rows), sum(len(r) for r in responses))

    with tempfile.TemporaryDirectory(prefix="specdistill-target-") as tmp:
        if target is not None:  # a GGUF target: the engine reads the HF folder written from its dequantised weights
            model_dir, gen_source = export_target(target.model, tokenizer, Path(tmp) / "target", target.fingerprint,
                                                  target.dtype), target.model
        else:
            model_dir = Path(target_cfg.name_or_path)
            gen_source = SimpleNamespace(generation_config=generation_config(target_cfg))
        job = {"target": str(model_dir), "revision": None if target is not None else target_cfg.revision,
               "dtype": target_cfg.dtype, "max_model_len": longest + gen_cfg.max_new_tokens,
               "max_num_seqs": gen_cfg.batch_size,
               "seed": gen_cfg.seed, "tensor_parallel_size": gen_cfg.engine_tp,
               "sampling": {"temperature": gen_cfg.temperature, "top_p": gen_cfg.top_p, "top_k": gen_cfg.top_k,
                            "max_tokens": gen_cfg.max_new_tokens, "logprobs": gen_cfg.topk_logprobs,
                            "stop_token_ids": sorted(stop_ids(gen_source, tokenizer))}}
        return generate_with_engine(job, shards, workers=gen_cfg.engine_workers, device=gen_cfg.engine_device,
                                    tp=gen_cfg.engine_tp, timeout_s=gen_cfg.engine_timeout_s, on_shard=on_shard)


def generation_config(target_cfg: TargetConfig) -> Any:
    """The target's generation config (its eos ids) without its weights; None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(target_cfg.name_or_path, revision=target_cfg.revision)
    except OSError:
        return None


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
    old = read_record(path) if path.exists() else {}
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
    write_record(path, metrics, {"tokens_per_s": metrics["generation"]["tokens_per_s"]})
    return metrics


def content_hash(ds: datasets.Dataset) -> str:
    """A hash of what the prompts say, so rewriting identical prompts does not invalidate shards."""
    h = hashlib.sha256()
    for rid, prompt in zip(ds["id"], ds["prompt"], strict=True):
        h.update(rid.encode() + b"\0" + prompt.encode() + b"\1")
    return h.hexdigest()[:16]
