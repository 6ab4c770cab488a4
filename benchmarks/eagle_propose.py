"""What one EAGLE drafting round costs, without the target's noise around it.

    python benchmarks/eagle_propose.py [--eagle models/eagle] [--prompts 6] [--max-new-tokens 96] [--repeats 5]

Decodes --prompts MT-bench first turns at T=0 with the EAGLE head and the evaluate stage's loop,
recording every `propose` call's inputs (context, the target's features); then replays those calls
on a fresh proposer --repeats times, timing `propose` alone, and prints ms per call (median and range
over the repeats) with the tree's settings. Run it before and after a change to the drafting code on
the same recording to compare the two without the verification's timing noise. Needs
`dvc repro prepare train@eagle` first.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
from specdistill.decoding.loop import speculative_generate  # noqa: E402
from specdistill.decoding.protocols import SamplingConfig  # noqa: E402
from specdistill.decoding.verifier import TargetVerifier  # noqa: E402
from specdistill.methods.eagle.model import load_eagle  # noqa: E402
from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig  # noqa: E402


def record(proposer: EagleProposer, verifier: TargetVerifier, prompts: list[list[int]], max_new: int,
           stops: set[int]) -> list[list[tuple]]:
    """Per prompt, the (context, max_depth, features) of each round, as the loop passed them."""
    calls: list[list[tuple]] = []
    propose = proposer.propose

    def recording(context, max_depth, sampling, generator, features=None):
        calls[-1].append((list(context), max_depth, None if features is None else features.clone()))
        return propose(context, max_depth, sampling, generator, features)

    proposer.propose = recording
    try:
        for prompt in prompts:
            calls.append([])
            speculative_generate(verifier, proposer, prompt, max_new, stops)
    finally:
        del proposer.propose
    return calls


@torch.inference_mode()
def replay(proposer: EagleProposer, calls: list[list[tuple]]) -> tuple[float, float]:
    """(ms per propose call, mean nodes per tree) over one pass of the recording."""
    seconds, nodes, n = 0.0, 0, 0
    for rounds in calls:
        proposer.reset()
        for context, max_depth, features in rounds:
            t0 = time.perf_counter()
            tree = proposer.propose(context, max_depth, SamplingConfig(), None, features)
            seconds += time.perf_counter() - t0
            nodes += len(tree) if tree is not None else 0
            n += 1
    return seconds / n * 1000, nodes / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle", default=str(ROOT / "models/eagle"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--total-tokens", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    target = load_target(target_config(args.dtype))
    model, tok = target.model, target.tokenizer
    tree = EagleTreeConfig(depth=args.depth, top_k=args.top_k, total_tokens=args.total_tokens)
    proposer = EagleProposer(load_eagle(args.eagle, model, dtype=model.dtype), tree)
    prompts = [ids for _, ids in mtbench_first_turns(tok, args.prompts)]
    calls = record(proposer, TargetVerifier(model, 4096, proposer.feature_layers), prompts, args.max_new_tokens,
                   stop_ids(model, tok))
    replay(proposer, calls)  # warm-up
    runs = [replay(proposer, calls) for _ in range(args.repeats)]
    ms = [r[0] for r in runs]
    result = {"calls": sum(len(c) for c in calls), "ms_per_call_median": round(statistics.median(ms), 3),
              "ms_per_call_min": round(min(ms), 3), "ms_per_call_max": round(max(ms), 3),
              "nodes_per_tree": round(runs[0][1], 2), "settings": {**vars(args), **environment()}}
    print(f"{result['calls']} propose calls, {result['nodes_per_tree']} nodes per tree: "
          f"{result['ms_per_call_median']:.2f} ms per call (median of {args.repeats}; "
          f"{result['ms_per_call_min']:.2f}-{result['ms_per_call_max']:.2f})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
