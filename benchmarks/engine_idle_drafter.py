"""What a K = 0 load costs in the engine with the drafter loaded, with and without skipping its forward.

    python benchmarks/engine_idle_drafter.py [--target models/export/target] [--draft models/export/eagle]
                                             [--method eagle3] [--k 1] [--prompts 8] [--max-new-tokens 96]
                                             [--concurrency 4 16] [--repeats 2]

A deployed schedule (`num_speculative_tokens_per_batch_size`) turns speculation off at high load, yet vLLM 0.32
still runs the drafter's forward on those steps (`propose` returns empty only after it), so such a load served
below the engine alone in the serve stage. Three engines serve the same MT-bench prompts (first turn, T=0) at
each concurrency: the engine alone, the drafter loaded with K = --k at batch 1 and K = 0 above, and the same
with `SPECDISTILL_SKIP_IDLE_DRAFTER=1` (engine-plugin/, `serve.skip_idle_drafter`). Starts alternate over
--repeats rounds; prints output tokens/s per start and each setting's ratio to the engine alone (mean of its
starts), with the machine. Needs `make engine` and the export stages.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _common import ROOT, engine_prompts

from specdistill.core.hardware import environment
from specdistill.engine.client import SKIP_IDLE_DRAFTER, run_engine

IDLE = {SKIP_IDLE_DRAFTER: "1"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "models/export/target")
    ap.add_argument("--draft", type=Path, default=ROOT / "models/export/eagle")
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    ps = engine_prompts(args.target, args.prompts)
    runs = [{"name": f"c{c}", "concurrency": c, "temperature": 0.0, "max_tokens": args.max_new_tokens,
             "prompts": [ps[i % len(ps)] for i in range(max(len(ps), 2 * c))], "ignore_eos": True}
            for c in args.concurrency]
    schedule = {"method": args.method, "model": str(args.draft), "num_speculative_tokens": args.k,
                "num_speculative_tokens_per_batch_size": [[1, 1, args.k], [2, 1024, 0]]}
    settings = {"alone": (None, None), "schedule": (schedule, None), "schedule, idle drafter skipped": (schedule, IDLE)}
    rates: dict[str, dict[str, list[float]]] = {s: {r["name"]: [] for r in runs} for s in settings}
    for rep in range(args.repeats):
        for label, (spec, env) in settings.items():
            res = run_engine({"target": str(args.target), "dtype": args.dtype, "max_model_len": 2048, "runs": runs,
                              "speculative_config": spec}, env=env)
            for r in res["runs"]:
                rates[label][r["name"]].append(r["output_tokens"] / r["wall_s"])
                print(f"round {rep + 1} {label:32s} {r['name']:>4s} {rates[label][r['name']][-1]:8.2f} tokens/s",
                      flush=True)
    alone = {c: statistics.fmean(v) for c, v in rates["alone"].items()}
    print(json.dumps({"tokens_per_s": {s: {c: [round(x, 2) for x in v] for c, v in by.items()}
                                       for s, by in rates.items()},
                      "over_alone": {s: {c: round(statistics.fmean(v) / alone[c], 3) for c, v in by.items()}
                                     for s, by in rates.items()},
                      "settings": vars(args) | {"target": str(args.target), "draft": str(args.draft)},
                      "environment": environment()}, indent=2, default=str))


if __name__ == "__main__":
    main()
