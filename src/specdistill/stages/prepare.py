"""prepare: prompt sets train / val (ShareGPT or any `datasets` source), mtbench and humaneval on disk."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from specdistill.core.config import section
from specdistill.core.data.prompts import (
    PrepareConfig,
    PromptError,
    SourceConfig,
    build_train_val,
    humaneval_rows,
    mix_summary,
    mtbench_rows,
    read_datasets_source,
    read_sharegpt_json,
)
from specdistill.core.io import save_dataset, write_json
from specdistill.core.models.target import TargetConfig, context_length, load_target_config, load_tokenizer
from specdistill.core.stage import check_outputs
from specdistill.core.tracking import wandb_run

log = logging.getLogger(__name__)


def save_split(rows: list[dict[str, Any]], final: Path) -> None:
    import datasets

    if not rows:
        raise PromptError(f"refusing to write an empty prompt set to {final}")
    save_dataset(datasets.Dataset.from_list(rows), final)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    data_cfg = dict(cfg["data"])
    src = section(SourceConfig, dict(data_cfg.pop("source")), "data.source")
    pcfg = section(PrepareConfig, data_cfg, "data", source=src)
    out = Path(cfg["paths"]["prompts_dir"])
    check_outputs(cfg, locked={"paths.prompts_dir": out})
    target_cfg = section(TargetConfig, dict(cfg["target"]), "target")
    context = context_length(load_target_config(target_cfg))
    if context is not None and pcfg.max_prompt_tokens >= context:
        raise PromptError(f"data.max_prompt_tokens={pcfg.max_prompt_tokens} leaves no room for an answer in the "
                          f"target's context of {context} positions: lower it (the answer needs "
                          "generate.max_new_tokens more)")
    tokenizer = load_tokenizer(target_cfg)
    with wandb_run(cfg.get("logger"), job_type="prepare", group=cfg.get("experiment_name", "default"),
                   config=cfg) as run_:
        summary = _prepare(src, pcfg, tokenizer, out, context)
        run_.summary.update({f"prepare/{k}_prompts": v["prompts"] for k, v in summary["splits"].items()})
    return summary


def _prepare(src: SourceConfig, pcfg: PrepareConfig, tokenizer: Any, out: Path,
             context: int | None = None) -> dict[str, Any]:
    if src.kind == "sharegpt_json":
        pairs = read_sharegpt_json(src.path)
    elif src.kind == "datasets":
        pairs = read_datasets_source(src)
    else:
        raise PromptError(f"data.source.kind={src.kind!r}: use sharegpt_json or datasets")
    train, val, stats = build_train_val(pairs, pcfg, tokenizer, source_name=src.name or "sharegpt")
    splits = {"train": train, "val": val,
              "mtbench": mtbench_rows(pcfg.mtbench_path, tokenizer, pcfg.num_mtbench),
              "humaneval": humaneval_rows(pcfg.humaneval_path, tokenizer, pcfg.num_humaneval)}
    summary: dict[str, Any] = {"filter": stats, "splits": {}}
    for name in ("mtbench", "humaneval"):  # benchmark prompts are not cut to max_prompt_tokens, only to fit at all
        fits = [r for r in splits[name] if context is None or r["prompt_tokens"] < context]
        if len(fits) < len(splits[name]):
            log.warning("%s: dropped %d prompt(s) longer than the target's context of %d positions",
                        name, len(splits[name]) - len(fits), context)
        splits[name] = fits
    for name, rows in splits.items():
        save_split(rows, out / name)
        n_tok = sum(r["prompt_tokens"] for r in rows)
        summary["splits"][name] = {"prompts": len(rows), "prompt_tokens": n_tok}
        log.info("%-9s %6d prompts, %8d prompt tokens", name, len(rows), n_tok)
    log.info("filtering: %s", stats)
    if pcfg.code_fraction is not None:  # only then, so a default run's prompts stay byte-identical
        summary["code_mix"] = {name: mix_summary(splits[name]) for name in ("train", "val")}
        log.info("code mix: %s", summary["code_mix"])
    write_json(out / "summary.json", summary)
    return summary
