"""What verifying a draft tree costs the target, by tree size: the budget behind a Medusa/EAGLE tree.

    python benchmarks/verify_cost.py [--context 300] [--nodes 0 1 2 4 8 16 32 64] [--repeats 24]

Batch size 1 with a KV cache of --context tokens, the decoder's own `TargetVerifier.score` on a
tree of n nodes (a binary-ish tree: each node's parent is (i-1)//2, so a tree mask is used) plus
the root; n = 0 is a plain decode step. Prints ms per verification (median of --repeats) and the
ratio to the plain step, measured in this process. A tree of n nodes pays off only when its
expected accepted length beats that ratio (tau >= cost ratio for a speed-up).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from _common import target_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdistill.core.hardware import environment  # noqa: E402
from specdistill.core.models.target import load_target  # noqa: E402
from specdistill.decoding.verifier import TargetVerifier  # noqa: E402
from specdistill.evaluation.autotune import binary_tree, verify_seconds  # noqa: E402
from specdistill.evaluation.contention import Contention, busy_warning  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--nodes", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=24)
    ap.add_argument("--target", default=str(ROOT / "data/assets/target"))
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    target = load_target(target_config(args.dtype, args.target))
    vocab = target.vocab_size
    context = torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    verifier = TargetVerifier(target.model, capacity=args.context + 4 * args.repeats + 128)
    nodes = sorted({0, *args.nodes})  # the plain step is the ratio's base
    busy = Contention().start()
    rows = {n: s * 1000 for n, s in verify_seconds(verifier, context, nodes, vocab, args.repeats, binary_tree).items()}
    others = busy.stop()
    base = rows[0]
    print(f"{'nodes':>6} {'ms':>8} {'x plain step':>13}")
    for n, ms in rows.items():
        print(f"{n:>6} {ms:8.1f} {ms / base:13.2f}")
    if warning := busy_warning(others, "verify_cost"):
        print(f"warning: {warning}")
    print(json.dumps({"context": args.context, "dtype": args.dtype, "ms": rows, "others_cpu_share": others,
                      **environment()}))


if __name__ == "__main__":
    main()
