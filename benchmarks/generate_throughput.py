"""Throughput of the generate stage's ways to answer, against HF `generate`: same prompts, same run.

    python benchmarks/generate_throughput.py [--prompts 64] [--batch-size 32] [--max-new-tokens 128]
                                             [--engine-workers 1 2] [--no-engine]

The ways to answer the same train prompts with the real target, at the same sampling settings:
  ours        specdistill.core.data.generation (length-sorted batches, preallocated KV cache, compaction)
  hf_batched  model.generate on the same batches (left padding, same batch size)
  hf_single   model.generate one prompt at a time (on the first --single-prompts prompts)
  vllm_wN     generate.engine=vllm: the serving engine with N workers (the cores split between them), the
              target exported for it as the stage does; its rate counts the cold start, `after_start` does not
Tokens are response tokens up to and including eos. Ratios are ours / each other way, measured in this
process; the settings are printed beside them. Needs `dvc repro prepare` first, and `make engine` for vllm.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _common import target_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdistill.core.data.generation import GenerateConfig, generate_shard  # noqa: E402
from specdistill.core.hardware import environment
from specdistill.core.models.target import (
    load_target,  # noqa: E402
    stop_ids,  # noqa: E402
)
from specdistill.engine.environment import engine_available  # noqa: E402
from specdistill.engine.generation import generate_with_engine  # noqa: E402
from specdistill.evaluation.prompts import load_prompts  # noqa: E402
from specdistill.export.target import export_target  # noqa: E402


def response_tokens(seq: list[int], stops: set[int]) -> int:
    for i, t in enumerate(seq):
        if t in stops:
            return i + 1
    return len(seq)


def hf_generate(model, tok, prompts: list[list[int]], cfg: GenerateConfig, stops: set[int]) -> int:
    """model.generate over the same length-sorted batches; returns response tokens."""
    pad = tok.pad_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    n = 0
    for s in range(0, len(order), cfg.batch_size):
        batch = [prompts[i] for i in order[s:s + cfg.batch_size]]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        kw = dict(do_sample=cfg.temperature > 0, max_new_tokens=cfg.max_new_tokens, pad_token_id=pad)
        if cfg.temperature > 0:
            kw.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        n += sum(response_tokens(row[width:].tolist(), stops) for row in out)
    return n


def engine_generate(model, tok, prompts: list[list[int]], cfg: GenerateConfig, stops: set[int], dtype: str,
                    workers: int) -> tuple[int, float]:
    """The engine's answers as the generate stage gets them (one shard per worker); (tokens, seconds after start)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="specdistill-bench-") as tmp:
        target_dir = export_target(model, tok, Path(tmp) / "target", "benchmark", model.dtype)
        per = -(-len(prompts) // workers)
        shards = [{"key": f"bench/shard-{w:05d}", "prompts": prompts[w * per:(w + 1) * per], "seed": w}
                  for w in range(workers)]
        job = {"target": str(target_dir), "dtype": dtype, "max_model_len": max(map(len, prompts)) + cfg.max_new_tokens,
               "max_num_seqs": cfg.batch_size, "seed": 0,
               "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                            "max_tokens": cfg.max_new_tokens, "logprobs": 0, "stop_token_ids": sorted(stops)}}
        tokens = []
        res = generate_with_engine(job, shards, workers=workers, device="cpu", tp=1, timeout_s=7200,
                                   on_shard=lambda key, rows, s: tokens.extend(len(r["response"]) for r in rows))
    return sum(tokens), max(r["seconds"] for r in res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--single-prompts", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts-dir", default=str(ROOT / "data/prompts"))
    ap.add_argument("--split", default="train")
    ap.add_argument("--engine-workers", type=int, nargs="*", default=[1, 2], help="vllm runs, one per worker count")
    ap.add_argument("--no-engine", action="store_true", help="leave out the serving engine")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()

    try:
        rows = list(load_prompts(args.prompts_dir, args.split).select(range(args.prompts)))
    except FileNotFoundError as e:
        sys.exit(str(e))
    target = load_target(target_config(args.dtype))
    model, tok = target.model, target.tokenizer
    cfg = GenerateConfig(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                         batch_size=args.batch_size, shard_size=len(rows), seed=0)
    stops = stop_ids(model, tok)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]

    results = {}

    def timed(name, fn):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        n = fn()
        dt = time.perf_counter() - t0
        results[name] = {"tokens": n, "seconds": round(dt, 2), "tokens_per_s": round(n / dt, 1)}
        print(f"{name:11s} {n:6d} tokens in {dt:7.1f} s = {n / dt:7.1f} tokens/s", flush=True)

    def ours():
        cols = generate_shard(model, tok, rows, cfg, shard_seed=0)
        return sum(len(s) - p for s, p in zip(cols["input_ids"], cols["prompt_len"], strict=True))

    # warm up both paths once (first-call allocations, oneDNN kernel selection)
    generate_shard(model, tok, rows[:2], GenerateConfig(max_new_tokens=4, batch_size=2), shard_seed=0)
    hf_generate(model, tok, prompts[:2], GenerateConfig(max_new_tokens=4, batch_size=2), stops)
    timed("ours", ours)
    timed("hf_batched", lambda: hf_generate(model, tok, prompts, cfg, stops))
    single = GenerateConfig(**{**vars(cfg), "batch_size": 1})
    timed("hf_single", lambda: hf_generate(model, tok, prompts[: args.single_prompts], single, stops))

    for workers in [] if args.no_engine or not engine_available() else args.engine_workers:
        t0 = time.perf_counter()
        n, after = engine_generate(model, tok, prompts, cfg, stops, args.dtype, workers)
        dt = time.perf_counter() - t0
        results[f"vllm_w{workers}"] = {"tokens": n, "seconds": round(dt, 2), "tokens_per_s": round(n / dt, 1),
                                       "after_start_s": round(after, 2),
                                       "after_start_tokens_per_s": round(n / after, 1)}
        print(f"vllm_w{workers:<6d} {n:6d} tokens in {dt:7.1f} s = {n / dt:7.1f} tokens/s; after its cold start "
              f"{n / after:7.1f} tokens/s", flush=True)

    ours_rate = results["ours"]["tokens_per_s"]
    ratios = {k: round(ours_rate / v["tokens_per_s"], 2) for k, v in results.items() if k != "ours"}
    ratios.update({f"{k}_after_start": round(ours_rate / v["after_start_tokens_per_s"], 2)
                   for k, v in results.items() if "after_start_tokens_per_s" in v})
    settings = {"prompts": len(rows), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature, "top_p": args.top_p, "dtype": args.dtype, **environment()}
    print("ratios ours / other:", json.dumps(ratios))
    print("settings:", json.dumps(settings))
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "ratios": ratios, "settings": settings}, indent=2))


if __name__ == "__main__":
    main()
