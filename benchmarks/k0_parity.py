"""Our K=0 loop (plain AR through the speculative loop) against HF `generate`, paired per prompt.

    python benchmarks/k0_parity.py [--prompts 24] [--max-new-tokens 64] [--temperature 0]

The evaluate stage measures a handful of prompts per setting, where machine noise (AR itself moves
by 20% between settings of one run here) hides a few-percent difference. This runs both methods on
each of --prompts MT-bench first turns, alternating which goes first, and reports the per-prompt
ratio of tokens/s (ours / HF), its geometric mean and a bootstrap 95% interval. Same process, same
target, same stops. Needs `dvc repro prepare` first.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
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
from specdistill.decoding.protocols import SamplingConfig  # noqa: E402
from specdistill.evaluation.runner import hf_method, our_method  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    target = load_target(target_config("bfloat16"))
    tok, model = target.tokenizer, target.model
    stops = stop_ids(model, tok)
    ours = our_method("ar", model, None, args.max_new_tokens, stops, 4096, 1)
    hf = hf_method("hf_generate", model, args.max_new_tokens, stops, tok.pad_token_id or 0)
    sampling = SamplingConfig(args.temperature)
    ratios = []
    for i, (_, prompt) in enumerate(mtbench_first_turns(tok, args.prompts)):
        speed = {}
        for m in ([ours, hf] if i % 2 == 0 else [hf, ours]):
            t0 = time.perf_counter()
            out, _ = m.generate(prompt, sampling, torch.Generator().manual_seed(i))
            speed[m.name] = len(out) / (time.perf_counter() - t0)
        ratios.append(speed["ar"] / speed["hf_generate"])
    logs = [math.log(r) for r in ratios]
    rng = random.Random(0)
    boots = sorted(math.exp(sum(rng.choices(logs, k=len(logs))) / len(logs)) for _ in range(2000))
    result = {"geomean_ratio": math.exp(sum(logs) / len(logs)), "ci95": [boots[49], boots[1949]],
              "min": min(ratios), "max": max(ratios), "below_1": sum(r < 1 for r in ratios), "n": len(ratios),
              "settings": vars(args), **environment()}
    print(f"ours / HF generate, tokens/s, {len(ratios)} prompts: geometric mean {result['geomean_ratio']:.3f}x "
          f"(95% CI {result['ci95'][0]:.3f}-{result['ci95'][1]:.3f}), range {min(ratios):.3f}-{max(ratios):.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
