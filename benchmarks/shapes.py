"""`eval.depth=auto` against every fixed shape it chose from, measured in one interleaved run.

    python benchmarks/shapes.py [--item eagle] [--shapes 0 1w1 2w1 3w1 1 2 3] [--temperatures 0]
                                [--num-prompts 4] [--max-new-tokens 64] [--out shapes.json]
                                [--set target.dtype=float32 decode.lookup.branches=3 ...]

Runs what the evaluate stage's `eval.depth=auto` runs first (evaluation/autotune.py: the target's verification
seconds per node count and a pilot on dev prompts, giving a predicted speed-up per shape), then decodes the
test prompts with plain AR and with the item's draft pruned to each shape in --shapes (depth d, "dwW": only the
first W children of each node, as `eval.depth` / `eval.width` set it), all in one process, in interleaved
order, as the evaluate stage runs its rows. Prints, per shape, predicted and measured speed-up over AR (95%
interval) and tau, and marks the shape auto chose: is it ever slower than the best fixed shape by more than the
noise? The item is an evaluate item of params.yaml (`evals.<item>`); needs what its stage needs
(`dvc repro train@eagle prepare` for eagle). The speed-ups are this machine's: note its CPU kind beside them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdistill import methods  # noqa: E402
from specdistill.core.config import section  # noqa: E402
from specdistill.core.hardware import environment  # noqa: E402
from specdistill.core.models.target import TargetConfig, load_target  # noqa: E402
from specdistill.evaluation.autotune import Capped  # noqa: E402
from specdistill.evaluation.contention import Contention, busy_warning  # noqa: E402
from specdistill.evaluation.prompts import chat_encoder, load_conversations  # noqa: E402
from specdistill.evaluation.runner import our_method, run_benchmark  # noqa: E402
from specdistill.stages.evaluate import EvalConfig, auto_depth, eval_item, pilot_conversations  # noqa: E402


def shape(label: str) -> tuple[int, int | None]:
    """'2w1' -> (2, 1); '3' -> (3, None): the autotune's labels."""
    m = re.fullmatch(r"(\d+)(?:w(\d+))?", label)
    if not m:
        raise SystemExit(f"--shapes {label!r}: a depth (0 = AR), or depth w width, e.g. 2w1")
    return int(m[1]), None if m[2] is None else int(m[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--item", default="eagle", help="an evaluate item of params.yaml (evals.<item>)")
    ap.add_argument("--shapes", nargs="+", default=["0", "1w1", "2w1", "3w1", "1", "2", "3"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    ap.add_argument("--num-prompts", type=int, default=None, help="per dataset (default: the item's)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the item's")
    ap.add_argument("--pilot-only", action="store_true",
                    help="print the pilot's prediction per shape and stop (compare pilot sizes: --set "
                         "evals.<item>.pilot_prompts=N)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table as JSON here")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="dotted keys over params.yaml, values in YAML (evals.lookup.k=4, target.dtype=float32)")
    args = ap.parse_args()
    shapes = {label: shape(label) for label in args.shapes}

    params = OmegaConf.load(ROOT / "params.yaml")
    for kv in args.set:
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"--set {kv!r}: write KEY=VALUE")
        OmegaConf.update(params, key, yaml.safe_load(value), force_add=True)
    cfg = OmegaConf.to_container(params, resolve=True)
    cfg["eval"]["name"] = args.item
    item = eval_item(cfg)
    item.update(depth=None, width=None, beside=[], temperatures=args.temperatures, hf_baselines=False)
    item.update({k: v for k, v in (("num_prompts", args.num_prompts), ("max_new_tokens", args.max_new_tokens))
                 if v is not None})
    eval_cfg = section(EvalConfig, item, "eval")
    if eval_cfg.branch:  # the stage merges the companion's tree (UnionProposer); this benchmark drafts the method alone
        raise SystemExit(f"--item {args.item}: its eval.branch={eval_cfg.branch} is not measured here; use an item "
                         "without a branch")
    dec = methods.decode_settings(cfg, eval_cfg.method, eval_cfg.decode)
    prompts_dir = ROOT / cfg["paths"]["prompts_dir"]
    data = {d: load_conversations(prompts_dir, d, eval_cfg.num_prompts, eval_cfg.split) for d in eval_cfg.datasets}
    pilot = pilot_conversations(eval_cfg, prompts_dir)
    target_cfg = section(TargetConfig, {**cfg["target"], "name_or_path": str(ROOT / cfg["target"]["name_or_path"])},
                   "target")
    target = load_target(target_cfg)
    encode = chat_encoder(target.tokenizer)
    drafting = methods.get(eval_cfg.method, "evaluate", "eval.method").draft(eval_cfg, target, dec)
    stops = target.stop_ids

    busy = Contention().start()  # what else ran on these CPUs from the pilot to the last decoded token
    auto = auto_depth(eval_cfg, target.model, drafting.proposer, drafting.max_depth, pilot, encode, stops)
    print(f"auto: {auto['choice']} (pilot {auto['pilot_rounds']} rounds, {auto['seconds']:.0f} s); "
          f"verification ms by nodes: " + ", ".join(f"{n}: {s * 1000:.0f}" for n, s in auto["verify_s"].items()))
    if args.pilot_only:
        for label, p in auto["predicted"].items():
            print(f"{label:6} tau {p['tau']:.3f}  nodes {p['nodes']:5.2f}  round {p['round_s'] * 1000:5.1f} ms  "
                  f"predicted {p['speedup']:.2f}x (se {p['speedup_se']:.3f}, gap to the best's se "
                  f"{p['se_vs_best']:.3f})")
        return
    shapes.setdefault(auto["choice"], (auto["depth"], auto["width"]))  # the chosen shape is always measured

    rows = [our_method("ar", target.model, None, eval_cfg.max_new_tokens, stops, eval_cfg.capacity, drafting.max_depth)]
    rows += [our_method(label, target.model, Capped(drafting.proposer, d, w), eval_cfg.max_new_tokens, stops,
                        eval_cfg.capacity, drafting.max_depth) for label, (d, w) in shapes.items() if d > 0]
    res = run_benchmark(rows, data, eval_cfg.temperatures, eval_cfg.top_p, eval_cfg.top_k, encode,
                        target.tokenizer.decode, eval_cfg.seed)
    table, chosen = [], "ar" if auto["choice"] == "0" else auto["choice"]
    for (ds, temp, name), tally in sorted(res.tallies.items()):
        s = tally.summary(res.tallies[(ds, temp, "ar")])
        p = auto["predicted"].get(name, {})
        table.append({"dataset": ds, "temperature": temp, "shape": name, "chosen": name == chosen,
                      "predicted": p.get("speedup"), "measured": s.get("speedup"), "ci95": s.get("speedup_ci95"),
                      "tau": s.get("tau", 1.0), "predicted_tau": p.get("tau")})
    print(f"\n{'set':10} {'T':4} {'shape':6} {'predicted':>9} {'measured (95% CI)':>24} {'tau':>5}")
    for r in table:
        ci = "-".join(f"{x:.2f}" for x in r["ci95"]) if r["ci95"] else ""
        pred = f"{r['predicted']:.2f}x" if r["predicted"] else ""
        print(f"{r['dataset']:10} {r['temperature']:4} {r['shape'] + ('*' if r['chosen'] else ''):6} {pred:>9} "
              f"{r['measured'] or 1.0:>9.2f}x ({ci:>11}) {r['tau']:5.2f}")
    print("* chosen by eval.depth=auto")
    others = busy.stop()
    if warning := busy_warning(others, "shapes.py"):
        print(f"warning: {warning}")
    if args.out:
        args.out.write_text(json.dumps({"item": args.item, "set": args.set, "auto": auto, "table": table,
                                        "dtype": target_cfg.dtype, "others_cpu_share": others,
                                        **environment()}, indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
