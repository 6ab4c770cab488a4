"""The serve stage's engine starts, each in a process of its own or one after another in one process: the wall
time of the whole, and whether the engine serves at the same speed either way.

    python benchmarks/engine_starts.py [--target models/export/target] [--k 2] [--prompts 2]
                                       [--max-new-tokens 32] [--repeats 2] [--dtype bfloat16]

A serve item starts the engine alone and then the engine with each K; every start pays a cold start, and a start in
its own worker process pays `import vllm` too. This runs the same starts (the engine alone, then vLLM's n-gram
drafter at K: nothing to train) both ways, alternating, --repeats times: `run_engine` per start (a process each, as
the serve stage did) and `run_engines` (one worker process, each engine shut down before the next). Prints the wall
seconds of each way with its cold starts and shut-downs, the output tokens/s of every start, and the machine's kind.
Needs `make engine` and the target's export (`dvc repro export_target`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _common import ROOT, engine_prompts

from specdistill.core.hardware import environment
from specdistill.engine.client import run_engine, run_engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "models/export/target")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    runs = [{"name": "mtbench", "concurrency": 1, "temperature": 0.0, "max_tokens": args.max_new_tokens,
             "prompts": engine_prompts(args.target, args.prompts), "ignore_eos": True}]
    base = {"target": str(args.target), "dtype": args.dtype, "max_model_len": 2048, "runs": runs}
    jobs = [base, {**base, "speculative_config": {"method": "ngram", "num_speculative_tokens": args.k,
                                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1}}]
    ways = {"a process per start": lambda: [run_engine(j) for j in jobs], "one process": lambda: run_engines(jobs)}
    out: dict[str, list[dict]] = {way: [] for way in ways}
    for i in range(args.repeats):
        for way, start in (ways.items() if i % 2 == 0 else reversed(ways.items())):  # alternate the order
            t0 = time.perf_counter()
            results = start()
            wall = time.perf_counter() - t0
            row = {"wall_s": round(wall, 1), "cold_start_s": [round(r["cold_start_s"], 1) for r in results],
                   "stop_s": [round(r.get("stop_s", 0.0), 1) for r in results],
                   "tokens_per_s": [round(r["runs"][0]["output_tokens"] / r["runs"][0]["wall_s"], 2) for r in results]}
            out[way].append(row)
            print(f"{way:22s} {row['wall_s']:6.1f} s   cold starts {row['cold_start_s']}  shut-downs {row['stop_s']}  "
                  f"tokens/s (alone, ngram K={args.k}) {row['tokens_per_s']}", flush=True)
    summary = {way: {"wall_s_median": statistics.median(r["wall_s"] for r in rows),
                     "tokens_per_s_median": [statistics.median(r["tokens_per_s"][j] for r in rows)
                                             for j in range(len(jobs))]} for way, rows in out.items()}
    print(json.dumps({"runs": out, "summary": summary, "starts": len(jobs), "environment": environment()}, indent=2))


if __name__ == "__main__":
    main()
