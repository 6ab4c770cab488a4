"""What one decode step costs: the target against drafts of each size, full and reduced vocabulary.

    python benchmarks/draft_step.py [--context 300] [--steps 64] [--vocab 8192]

Batch size 1 with a KV cache, as in speculative decoding: a context of --context tokens is
prefilled, then --steps single-token steps are timed (median of 3 repeats). The same proposer code
the decoder uses (`DraftLMProposer._forward`, which also scatters a reduced head's logits back to
the target's vocabulary). Prints ms per step and the ratio to the target's step, in this process.
Untrained drafts (`init=from_target`): the cost does not depend on the weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import target_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdistill.core.hardware import environment
from specdistill.core.models.target import load_target  # noqa: E402
from specdistill.methods.draft.model import DraftSize, build_draft  # noqa: E402
from specdistill.methods.draft.proposer import DraftLMProposer  # noqa: E402


@torch.inference_mode()
def step_ms(model, context: list[int], steps: int) -> float:
    proposer = DraftLMProposer(model.eval(), k=1, capacity=len(context) + steps + 8)
    times = []
    for _ in range(3):
        proposer.reset()
        proposer._forward(context)
        t0 = time.perf_counter()
        for i in range(steps):
            proposer._forward([context[i % len(context)]])
        times.append((time.perf_counter() - t0) / steps * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    target = load_target(target_config(args.dtype))
    dtype = target.dtype
    context = torch.randint(100, target.vocab_size, (args.context,),
                            generator=torch.Generator().manual_seed(0)).tolist()
    rows = {"target (30 layers, full head)": step_ms(target.model, context, args.steps)}
    d2t = torch.arange(args.vocab)  # which ids does not change the cost
    for name, layers in (("xs", 1), ("s", 2), ("m", 4)):
        for vocab, ids in (("full", None), (str(args.vocab), d2t)):
            draft = build_draft(target.model, DraftSize(name, num_layers=layers), "from_target", d2t=ids).to(dtype)
            rows[f"draft {name} ({layers} layer{'s' if layers > 1 else ''}, {vocab} head)"] = step_ms(draft, context,
                                                                                                     args.steps)
    base = rows["target (30 layers, full head)"]
    for name, ms in rows.items():
        print(f"{name:42s} {ms:7.2f} ms/step  {ms / base:6.1%} of the target's step")
    print(json.dumps({"settings": vars(args), **environment(), "ms_per_step": rows}))


if __name__ == "__main__":
    main()
