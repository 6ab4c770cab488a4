"""The engine's CPU settings, measured: Intel OpenMP preloaded or not, both cores bound or vLLM's default, and the
engine core in a process of its own (vLLM's default) or in the worker's.

    python benchmarks/engine_env.py [--target models/export/target] [--draft models/export/eagle | ngram] [--k 3]
                                    [--prompts 4] [--max-new-tokens 96] [--concurrency 1] [--layout-only]

vLLM warns that speculative decoding on a CPU without Intel OpenMP (libiomp5) in LD_PRELOAD is much slower,
and by default binds its worker to all cores but one (one of two here); its `LLM` runs the engine core in a process
of its own and the model in a third, which on 2 cores compete. One engine start per setting, each
serving the same MT-bench prompts (first turn, T=0) with and without the draft in the same start order;
prints output tokens/s per setting and the ratio to the first setting's engine alone (vLLM's defaults), with the
machine's kind, and each start's cold start. `serve.iomp` / `serve.threads` / `serve.multiprocessing` take the
winner. Needs `make engine` and the export stages.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import ROOT, engine_prompts

from specdistill.core.hardware import environment
from specdistill.engine.client import run_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "models/export/target")
    ap.add_argument("--draft", default=str(ROOT / "models/export/eagle"),
                    help="an exported EAGLE-3 head, or `ngram` (the engine's prompt lookup: needs only the target)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layout-only", action="store_true",
                    help="only the engine core's two layouts, with Intel OpenMP and both cores bound")
    args = ap.parse_args()
    ps = engine_prompts(args.target, args.prompts)
    runs = [{"name": "mtbench", "concurrency": args.concurrency, "temperature": 0.0, "max_tokens": args.max_new_tokens,
             "prompts": ps, "ignore_eos": True}]
    if args.draft == "ngram":
        label_spec, spec = "ngram", {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 1}
    else:
        label_spec, spec = "eagle", {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k}
    rows, cold = {}, {}
    # vLLM's layout (core in its own process) with each OpenMP / binding choice, then the winners' in one process
    settings = [(iomp, threads, True) for iomp in (False, True) for threads in (None, "0-1")] + [(True, "0-1", False)]
    if args.layout_only:
        settings = [(True, "0-1", True), (True, "0-1", False)]
    for iomp, threads, multiprocessing in settings:
        for label, sc in (("alone", None), (label_spec, spec)):
            res = run_engine({"target": str(args.target), "dtype": args.dtype, "max_model_len": 2048,
                              "runs": runs, "speculative_config": sc}, threads=threads, iomp=iomp,
                             multiprocessing=multiprocessing)
            r = res["runs"][0]
            key = (f"iomp={'on' if iomp else 'off'} threads={threads or 'vllm default'} "
                   f"core={'own process' if multiprocessing else 'in-process'} {label}")
            rows[key], cold[key] = round(r["output_tokens"] / r["wall_s"], 2), round(res["cold_start_s"], 1)
            print(f"{key:65s} {rows[key]:8.2f} tokens/s  (cold start {cold[key]:.0f} s)", flush=True)
    base = next(iter(rows.values()))  # the first setting's engine alone: vLLM's defaults unless --layout-only
    print(json.dumps({"tokens_per_s": rows, "ratio_to_first_alone": {k: round(v / base, 3) for k, v in rows.items()},
                      "cold_start_s": cold, "environment": environment()}, indent=2))


if __name__ == "__main__":
    main()
