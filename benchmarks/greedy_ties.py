"""Why speculative greedy output can differ from AR greedy output in bfloat16, measured.

    python benchmarks/greedy_ties.py [--eagle models/eagle] [--prompts 10] [--max-new-tokens 128] [--dtype bfloat16]

Speculative decoding is lossless in exact arithmetic: at T=0 it emits the target's argmax chain. A
verification forward scores several positions at once, and in bfloat16 a matmul over a different
number of rows rounds differently from a one-token decode step, so where the target's top two
logits (nearly) tie the argmax can flip, and from there the outputs part. This runs AR and EAGLE
speculative greedy decoding (the evaluate stage's loops) on MT-bench first turns, and at each first
divergence recomputes the target's logits for the shared prefix in float32: if the loops are
right, every divergence sits on a near-tie (a top-2 gap of a few bfloat16 ulps), and in float32 no
divergence happens at all. Needs `dvc repro prepare train@eagle` first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from _common import mtbench_first_turns, target_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdistill.core.hardware import environment
from specdistill.core.models.target import (
    load_target,  # noqa: E402
    stop_ids,  # noqa: E402
)
from specdistill.decoding.loop import speculative_generate  # noqa: E402
from specdistill.decoding.verifier import TargetVerifier  # noqa: E402
from specdistill.methods.eagle.model import load_eagle  # noqa: E402
from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle", default=str(ROOT / "models/eagle"))
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--target", default=str(ROOT / "data/assets/target"))
    ap.add_argument("--prompts-dir", default=str(ROOT / "data/prompts"))
    args = ap.parse_args()
    target = load_target(target_config(args.dtype, args.target))
    model, tok = target.model, target.tokenizer
    reference = model if args.dtype == "float32" else None
    stops = stop_ids(model, tok)
    proposer = EagleProposer(load_eagle(args.eagle, model, dtype=model.dtype), EagleTreeConfig(), capacity=4096)
    ar_ver = TargetVerifier(model, 4096)
    spec_ver = TargetVerifier(model, 4096, proposer.feature_layers)
    rows = []
    for conv_id, prompt in mtbench_first_turns(tok, args.prompts, args.prompts_dir):
        ar = speculative_generate(ar_ver, None, prompt, args.max_new_tokens, stops).tokens
        spec = speculative_generate(spec_ver, proposer, prompt, args.max_new_tokens, stops).tokens
        i = next((j for j, (a, b) in enumerate(zip(ar, spec, strict=False)) if a != b), None)
        row = {"id": conv_id, "ar_tokens": len(ar), "spec_tokens": len(spec), "first_divergence": i}
        if i is not None:
            if reference is None:
                reference = load_target(target_config("float32", args.target)).model
            with torch.inference_mode():
                logits = reference(input_ids=torch.tensor([prompt + ar[:i]])).logits[0, -1].float()
            top = torch.topk(logits, 2)
            row.update({"ar_token": ar[i], "spec_token": spec[i], "fp32_top2": top.indices.tolist(),
                        "fp32_gap": round(float(top.values[0] - top.values[1]), 4),
                        "bf16_ulp_at_top": float(torch.finfo(torch.bfloat16).eps * top.values[0].abs())})
        rows.append(row)
        print(json.dumps(row))
    parted = [r for r in rows if r["first_divergence"] is not None]
    print(json.dumps({"prompts": len(rows), "diverged": len(parted), "dtype": args.dtype,
                      "max_fp32_gap_at_divergence": max((r["fp32_gap"] for r in parted), default=None),
                      **environment()}))


if __name__ == "__main__":
    main()
