"""EAGLE alone, prompt lookup alone and EAGLE + lookup unions of several sizes, interleaved in one process.

    python benchmarks/eagle_lookup_variants.py [--eagle models/eagle] [--prompts 4] [--variants ...] [--out FILE]

Runs the evaluate stage's benchmark (MT-bench both turns and HumanEval, the order of methods rotating from
prompt to prompt) at T=0 with AR and every variant, so each speed-up divides by the AR of the same run,
and prints tau, speed-up (jackknife-t 95% interval) and the draft / verify seconds per variant and set.
A variant is `eagle`, `lookup`, or `u:<nodes>:<lookup_k>:<min_ngram>`: the union of a dynamic EAGLE tree
of <nodes> nodes (depth / top_k: 3 / 2 up to 6 nodes, 3 / 3 up to 8, 4 / 4 above) and a lookup chain. Needs `dvc repro prepare train@eagle` first. The README's lookup-branch choices come from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml
from _common import ROOT, target_config

from specdistill.data.generation import stop_ids
from specdistill.decoding.eagle import EagleProposer, EagleTreeConfig
from specdistill.decoding.proposers import PromptLookupProposer
from specdistill.decoding.union import UnionProposer
from specdistill.evaluation.runner import our_method, run_benchmark
from specdistill.models.eagle import load_eagle
from specdistill.models.target import load_target
from specdistill.stages.evaluate import chat_encoder, load_conversations

DEFAULT = ["eagle", "lookup", "u:8:4:1", "u:8:8:1", "u:8:8:2", "u:8:12:1", "u:6:8:1", "u:12:8:1"]


def tree(nodes: int) -> EagleTreeConfig:
    if nodes <= 6:
        return EagleTreeConfig(shape="dynamic", depth=3, top_k=2, total_tokens=nodes)
    if nodes <= 8:
        return EagleTreeConfig(shape="dynamic", depth=3, top_k=3, total_tokens=nodes)
    return EagleTreeConfig(shape="dynamic", depth=4, top_k=4, total_tokens=nodes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eagle", default=str(ROOT / "models/eagle"))
    ap.add_argument("--prompts", type=int, default=None, help="per set (default: params.yaml's eval.num_prompts)")
    ap.add_argument("--variants", nargs="+", default=DEFAULT)
    ap.add_argument("--out", default=None, help="also write the summary as JSON here")
    args = ap.parse_args()
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    ev = params["eval"]
    target = load_target(target_config(params["target"]["dtype"]))
    tok, model = target.tokenizer, target.model
    head = load_eagle(args.eagle, model, dtype=model.dtype, target_fingerprint=target.fingerprint)

    def variant(name: str):
        if name == "eagle":
            return EagleProposer(head, EagleTreeConfig(**ev["eagle_tree"]))
        if name == "lookup":
            return PromptLookupProposer(ev["lookup_k"], ev["lookup_max_ngram"], ev["lookup_min_ngram"])
        try:
            _, nodes, k, lo = name.split(":")
            return UnionProposer(EagleProposer(head, tree(int(nodes))), PromptLookupProposer(int(k), max(3, int(lo)), int(lo)))
        except ValueError as e:
            raise SystemExit(f"variant {name!r}: use eagle, lookup or u:<nodes>:<lookup_k>:<min_ngram> ({e})") from e

    n = args.prompts or ev["num_prompts"]
    data = {d: load_conversations(ROOT / "data/prompts", d, n) for d in ("mtbench", "humaneval")}
    stops = stop_ids(model, tok)
    max_pos = 16  # acceptance by position is tallied up to here (unprinted)
    methods = [our_method(v, model, None if v == "ar" else variant(v), ev["max_new_tokens"], stops, ev["capacity"], max_pos)
               for v in ["ar", *args.variants]]
    res = run_benchmark(methods, data, [0.0], 1.0, 0, chat_encoder(tok), tok.decode, ev["seed"])
    out = {}
    for (dataset, _, name), tally in sorted(res.tallies.items()):
        s = tally.summary(res.tallies[(dataset, "T0", "ar")])
        out.setdefault(dataset, {})[name] = {k: s.get(k) for k in ("tau", "speedup", "speedup_ci95", "draft_s", "verify_s")}
        ci = s.get("speedup_ci95") or [float("nan")] * 2
        print(f"{dataset:9s} {name:10s} tau {s.get('tau', 1):.2f}  {s.get('speedup', 1):.2f}x ({ci[0]:.2f}-{ci[1]:.2f})  "
              f"draft {s.get('draft_s', 0):.2f} s  verify {s.get('verify_s', 0):.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
