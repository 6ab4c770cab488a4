"""The engine's EAGLE-3 acceptance at T = 1, with and without per-request seeds, at concurrency 1 and 16.

    python benchmarks/engine_acceptance_t1.py [--k 3] [--prompts 8] [--max-new-tokens 64] [--dtype float32]
                                              [--probabilistic]

One engine start (the exported target + models/export/eagle), HumanEval first turns; prints drafts, accepted
tokens per position and the first position's acceptance for each run (docs/findings.md, "Open").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdistill.engine.client import run_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--probabilistic", action="store_true",
                    help="the draft samples from its distribution (vLLM's draft_sample_method=probabilistic) "
                         "instead of its argmax")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from specdistill.evaluation.prompts import chat_encoder, load_conversations

    target = ROOT / "models/export/target"
    encode = chat_encoder(AutoTokenizer.from_pretrained(target))
    ps = [encode([{"role": "user", "content": c.turns[0]}])
          for c in load_conversations(ROOT / "data/prompts", "humaneval", args.prompts)]
    runs = [{"name": f"seed={seed}|c={c}", "concurrency": c, "temperature": 1.0, "max_tokens": args.max_new_tokens,
             "prompts": [ps[i % len(ps)] for i in range(max(len(ps), 2 * c))], "seed": seed}
            for seed in (1234, None) for c in (1, 16)]
    res = run_engine({"target": str(target), "dtype": args.dtype, "max_model_len": 2048, "runs": runs,
                      "speculative_config": {"method": "eagle3", "model": str(ROOT / "models/export/eagle"),
                                             "num_speculative_tokens": args.k,
                                             **({"draft_sample_method": "probabilistic"}
                                                if args.probabilistic else {})}},
                     root=ROOT)
    for r in res["runs"]:
        s = r["spec"]
        drafts, per_pos = s["vllm:spec_decode_num_drafts"], s["vllm:spec_decode_num_accepted_tokens_per_pos"]
        print(f"{r['name']:20s} drafts {drafts:5d}  accepted per position {per_pos}  "
              f"alpha_pos1 {per_pos[0] / max(drafts, 1):.3f}")


if __name__ == "__main__":
    main()
