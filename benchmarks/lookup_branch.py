"""A prompt-lookup branch beside a trained draft: EAGLE, Medusa and lookup alone and their unions, in one process.

    python benchmarks/lookup_branch.py [--eagle models/eagle] [--medusa models/medusa] [--prompts 4] [--split dev]
                                       [--variants ...] [--out FILE]

Runs the evaluate stage's benchmark (MT-bench both turns and HumanEval, the order of methods rotating from
prompt to prompt) at T=0 with AR and every variant, so each speed-up divides by the AR of the same run,
and prints tau, speed-up (jackknife-t 95% interval) and the draft / verify seconds per variant and set.
A variant is `eagle`, `medusa`, `lookup`, `u:<nodes>:<lookup_k>:<min_ngram>[:<depth>:<top_k>]`: the union of a
dynamic EAGLE tree of <nodes> nodes (depth / top_k by default 3 / 2 up to 6 nodes, 3 / 3 up to 8, 4 / 4 above) \
and a lookup chain, or
`m:<lookup_k>:<min_ngram>`: Medusa's saved tree of decode.medusa.budget nodes and a lookup chain (is the branch
EAGLE's edge, or does every deterministic tree gain as much?). A `+b<N>` suffix on `lookup`, `u:` or `m:` makes
the lookup draft a tree of N sibling chains (`decode.lookup.branches`), e.g. `lookup+b2`, `u:8:8:1+b2`. \
It runs on the dev prompts by default (`eval.split`):
choose settings there, then report them on the test prompts with the evaluate stage. \
Needs `dvc repro prepare train@eagle` (and
`train@medusa` for the Medusa variants) first. The README's lookup-branch choices come from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import yaml
from _common import ROOT, target_config

from specdistill.core.models.target import load_target, stop_ids
from specdistill.decoding.union import UnionProposer
from specdistill.evaluation.prompts import SPLITS, chat_encoder, load_conversations
from specdistill.evaluation.runner import our_method, run_benchmark
from specdistill.methods.eagle.model import load_eagle
from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig
from specdistill.methods.lookup.proposer import PromptLookupProposer
from specdistill.methods.medusa import choices as medusa_choices
from specdistill.methods.medusa.model import load_medusa
from specdistill.methods.medusa.proposer import MedusaProposer

DEFAULT = ["eagle", "lookup", "u:8:4:1", "u:8:8:1", "u:8:8:2", "u:8:12:1", "u:6:8:1", "u:12:8:1"]


def tree(nodes: int, depth: int | None = None, top_k: int | None = None) -> EagleTreeConfig:
    if depth is not None:
        return EagleTreeConfig(shape="dynamic", depth=depth, top_k=top_k, total_tokens=nodes)
    if nodes <= 6:
        return EagleTreeConfig(shape="dynamic", depth=3, top_k=2, total_tokens=nodes)
    if nodes <= 8:
        return EagleTreeConfig(shape="dynamic", depth=3, top_k=3, total_tokens=nodes)
    return EagleTreeConfig(shape="dynamic", depth=4, top_k=4, total_tokens=nodes)


def parse(name: str) -> tuple[str, tuple[int, ...], int]:
    """A variant's kind, numbers and lookup branches; a bad name fails here, before the target loads."""
    base, _, b = name.partition("+b")
    branches = int(b) if b.isdigit() and int(b) >= 1 else 0
    if b and (not branches or base in ("eagle", "medusa")):
        raise SystemExit(f"variant {name!r}: +b<N> (N >= 1 lookup chains) goes on lookup, u: or m: variants")
    branches = branches or 1
    if base in ("eagle", "medusa", "lookup"):
        return base, (), branches
    kind, *rest = base.split(":")
    try:
        numbers = tuple(map(int, rest))
    except ValueError:
        numbers = ()
    if (kind, len(numbers)) not in (("u", 3), ("u", 5), ("m", 2)) or min(numbers) < 1:
        raise SystemExit(f"variant {name!r}: use eagle, medusa, lookup, "
                         "u:<nodes>:<lookup_k>:<min_ngram>[:<depth>:<top_k>] or "
                         "m:<lookup_k>:<min_ngram> (positive integers), with +b<N> for N lookup chains")
    return kind, numbers, branches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eagle", default=str(ROOT / "models/eagle"))
    ap.add_argument("--medusa", default=str(ROOT / "models/medusa"), help="read only for the medusa and m: variants")
    ap.add_argument("--prompts", type=int, default=None, help="per set (default: params.yaml's eval.num_prompts)")
    ap.add_argument("--split", choices=SPLITS, default="dev",
                    help="prompts to run: dev (default; tune here) or test (the evaluate stage's, to report)")
    ap.add_argument("--variants", nargs="+", default=DEFAULT)
    ap.add_argument("--params", default=str(ROOT / "params.yaml"),
                    help="the composed config whose eval settings to use "
                         "(e.g. one `make params EXPERIMENT=cpu_full` wrote); "
                         "the target and the prompts are still this checkout's")
    ap.add_argument("--out", default=None, help="also write the summary as JSON here")
    args = ap.parse_args()
    kinds = {v: parse(v) for v in args.variants}
    params = yaml.safe_load(Path(args.params).read_text())
    ev, dec = params["eval"], params["decode"]
    # the prompts before the target, so an overlapping dev set fails at once; dev must stay clear of the
    # eval.num_prompts test prompts the evaluate stage reports, whatever --prompts is
    n = args.prompts or ev["num_prompts"]
    data = {d: load_conversations(ROOT / "data/prompts", d, n, args.split, test_n=ev["num_prompts"])
            for d in ("mtbench", "humaneval")}
    target = load_target(target_config(params["target"]["dtype"]))
    tok, model = target.tokenizer, target.model
    # each draft loads only when a variant asks for it, so an EAGLE-only run needs no Medusa heads
    head = heads = choices = None
    used = {kind for kind, _, _ in kinds.values()}
    if used & {"eagle", "u"}:
        head = load_eagle(args.eagle, model, dtype=model.dtype, target_fingerprint=target.fingerprint)
    if used & {"medusa", "m"}:
        heads = load_medusa(args.medusa, dtype=model.dtype, target_fingerprint=target.fingerprint,
                            target=model).to(target.device)
        choices = medusa_choices(SimpleNamespace(choices=None, path=args.medusa, budget=dec["medusa"]["budget"]))

    def variant(name: str):
        kind, numbers, branches = kinds[name]

        def lookup(k: int, lo: int) -> PromptLookupProposer:
            return PromptLookupProposer(k, max(dec["lookup"]["max_ngram"], lo), lo, branches)

        if kind == "eagle":
            return EagleProposer(head, EagleTreeConfig(**dec["eagle"]["tree"]))
        if kind == "medusa":
            return MedusaProposer(heads, choices)
        if kind == "lookup":
            return lookup(dec["lookup"]["k"], dec["lookup"]["min_ngram"])
        if kind == "u":
            nodes, k, lo, *shape = numbers
            return UnionProposer(EagleProposer(head, tree(nodes, *shape)), lookup(k, lo))
        k, lo = numbers
        return UnionProposer(MedusaProposer(heads, choices), lookup(k, lo))

    stops = stop_ids(model, tok)
    max_pos = 16  # acceptance by position is tallied up to here (unprinted)
    methods = [our_method(v, model, None if v == "ar" else variant(v), ev["max_new_tokens"], stops,
                          ev["capacity"], max_pos)
               for v in ["ar", *args.variants]]
    res = run_benchmark(methods, data, [0.0], 1.0, 0, chat_encoder(tok), tok.decode, ev["seed"])
    out = {}
    for (dataset, _, name), tally in sorted(res.tallies.items()):
        s = tally.summary(res.tallies[(dataset, "T0", "ar")])
        out.setdefault(dataset, {})[name] = {k: s.get(k)
                                             for k in ("tau", "speedup", "speedup_ci95", "draft_s", "verify_s")}
        ci = s.get("speedup_ci95") or [float("nan")] * 2
        print(f"{dataset:9s} {name:10s} tau {s.get('tau', 1):.2f}  {s.get('speedup', 1):.2f}x "
              f"({ci[0]:.2f}-{ci[1]:.2f})  "
              f"draft {s.get('draft_s', 0):.2f} s  verify {s.get('verify_s', 0):.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
