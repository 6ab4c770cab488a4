"""The engine's CPU settings, measured: Intel OpenMP preloaded or not, both cores bound or vLLM's default.

    python benchmarks/engine_env.py [--target models/export/target] [--draft models/export/eagle] [--k 3]
                                    [--prompts 4] [--max-new-tokens 96] [--concurrency 1]

vLLM warns that speculative decoding on a CPU without Intel OpenMP (libiomp5) in LD_PRELOAD is much slower,
and by default binds its worker to all cores but one (one of two here). One engine start per setting, each
serving the same MT-bench prompts (first turn, T=0) with and without the draft in the same start order;
prints output tokens/s per setting and the ratio to vLLM's defaults (no iomp, default binding), with the
machine's kind. `serve.iomp` / `serve.threads` take the winner. Needs `make engine` and the export stages.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdistill.engine.client import run_engine  # noqa: E402
from specdistill.hardware import environment


def prompts(n: int, target: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from specdistill.evaluation.prompts import chat_encoder, load_conversations

    encode = chat_encoder(AutoTokenizer.from_pretrained(target))
    return [encode([{"role": "user", "content": c.turns[0]}])
            for c in load_conversations(ROOT / "data/prompts", "mtbench", n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "models/export/target")
    ap.add_argument("--draft", type=Path, default=ROOT / "models/export/eagle")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    ps = prompts(args.prompts, args.target)
    runs = [{"name": "mtbench", "concurrency": args.concurrency, "temperature": 0.0, "max_tokens": args.max_new_tokens,
             "prompts": ps, "ignore_eos": True}]
    spec = {"method": "eagle3", "model": str(args.draft), "num_speculative_tokens": args.k}
    rows = {}
    for iomp in (False, True):
        for threads in (None, "0-1"):
            for label, sc in (("alone", None), ("eagle", spec)):
                res = run_engine({"target": str(args.target), "dtype": args.dtype, "max_model_len": 2048,
                                  "runs": runs, "speculative_config": sc}, threads=threads, iomp=iomp)
                r = res["runs"][0]
                key = f"iomp={'on' if iomp else 'off'} threads={threads or 'vllm default'} {label}"
                rows[key] = round(r["output_tokens"] / r["wall_s"], 2)
                print(f"{key:45s} {rows[key]:8.2f} tokens/s  (cold start {res['cold_start_s']:.0f} s)", flush=True)
    base = rows["iomp=off threads=vllm default alone"]
    print(json.dumps({"tokens_per_s": rows, "ratio_to_defaults_alone": {k: round(v / base, 3) for k, v in rows.items()},
                      "environment": environment()}, indent=2))


if __name__ == "__main__":
    main()
