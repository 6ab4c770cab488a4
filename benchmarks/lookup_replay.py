"""Replay prompt-lookup drafts over the target's greedy answers: the tau each lookup setting would reach, no timing.

    python benchmarks/lookup_replay.py [--params params.yaml] [--prompts N] [--split dev] [--variants 8:1 8:2 16:1]
                                       [--answers FILE]

At T=0 a draft is kept up to its first token that differs from the target's greedy continuation, so running AR
once and replaying a proposer over its answers gives that proposer's tau exactly (up to the bfloat16 ties where a
verification forward rounds differently from a one-token step: `benchmarks/greedy_ties.py`), for any number of
settings, in seconds. A variant is `<lookup_k>:<branches>` (`decode.lookup.k`, `decode.lookup.branches`; n-grams from
the params' `decode.lookup.min_ngram`..`max_ngram`). It prints tau and the drafted nodes per round, the
verification's size, per set. What it cannot say is the speed-up: more nodes cost more verification, which
`benchmarks/lookup_branch.py` measures. The AR answers of MT-bench's second turns continue AR's own first answers,
as in the evaluate stage; `--answers` keeps them (JSON) so another replay skips the target.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml
from _common import ROOT, target_config

from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.tree import DraftTree
from specdistill.methods.lookup.proposer import PromptLookupProposer


def record(params: dict, n: int, split: str) -> list[dict]:
    """AR's greedy answers on the evaluate stage's prompts: [{dataset, prompt, tokens}] per turn."""
    from specdistill.core.models.target import load_target
    from specdistill.evaluation.prompts import chat_encoder, load_conversations
    from specdistill.evaluation.runner import our_method, run_benchmark

    ev = params["eval"]
    data = {d: load_conversations(ROOT / "data/prompts", d, n, split, test_n=ev["num_prompts"])
            for d in ("mtbench", "humaneval")}
    target = load_target(target_config(params["target"]["dtype"]))
    ar = our_method("ar", target.model, None, ev["max_new_tokens"], target.stop_ids, ev["capacity"], 1)
    turns: list[dict] = []
    generate = ar.generate

    def keep(prompt, sampling, generator):  # the runner's turns in order: this sees each prompt with its history
        tokens, info = generate(prompt, sampling, generator)
        turns.append({"prompt": prompt, "tokens": tokens})
        return tokens, info

    ar.generate = keep
    res = run_benchmark([ar], data, [0.0], 1.0, 0, chat_encoder(target.tokenizer), target.tokenizer.decode, ev["seed"])
    for turn, sample in zip(turns, res.samples, strict=True):
        turn["dataset"] = sample["dataset"]
    return turns


def accepted(tree: DraftTree | None, continuation: list[int]) -> int:
    """The longest root path of `tree` that the continuation follows (the greedy verifier's kept path)."""
    if tree is None:
        return 0
    node, depth = -1, 0
    while depth < len(continuation):
        nxt = [c for c in tree.children(node) if int(tree.tokens[c]) == continuation[depth]]
        if not nxt:
            break
        node, depth = nxt[0], depth + 1
    return depth


def replay(turn: dict, proposer: PromptLookupProposer, max_new_tokens: int) -> tuple[int, int, int]:
    """(tokens, target forwards, drafted nodes) of speculative decoding with `proposer` along AR's answer."""
    out, greedy = turn["tokens"], SamplingConfig()
    i, rounds, nodes = 1, 0, 0  # the prefill emits out[0]
    while i < len(out):
        # the loop's depth budget: accepted + bonus must fit in max_new_tokens
        tree = proposer.propose(turn["prompt"] + out[:i], max_new_tokens - i - 1, greedy, None)
        nodes += len(tree) if tree is not None else 0
        i += accepted(tree, out[i:]) + 1
        rounds += 1
    return len(out), rounds + 1, nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default=str(ROOT / "params.yaml"),
                    help="the composed config whose eval settings to use")
    ap.add_argument("--prompts", type=int, default=None, help="per set (default: the params' eval.num_prompts)")
    ap.add_argument("--split", choices=("dev", "test"), default="dev")
    ap.add_argument("--variants", nargs="+", default=["8:1", "8:2", "8:3", "16:1", "32:1"],
                    help="<lookup_k>:<branches>")
    ap.add_argument("--answers", default=None, help="AR's answers as JSON: read if it exists, else written")
    args = ap.parse_args()
    try:
        variants = {v: tuple(int(x) for x in v.split(":")) for v in args.variants}
        assert all(len(kb) == 2 and min(kb) >= 1 for kb in variants.values())
    except (ValueError, AssertionError):
        raise SystemExit(f"--variants {args.variants}: each is <lookup_k>:<branches>, "
                         "positive integers, e.g. 8:2") from None
    params = yaml.safe_load(Path(args.params).read_text())
    ev = params["eval"]
    answers = Path(args.answers) if args.answers else None
    if answers is not None and answers.exists():
        turns = json.loads(answers.read_text())
    else:
        turns = record(params, args.prompts or ev["num_prompts"], args.split)
        if answers is not None:
            answers.write_text(json.dumps(turns))
    for dataset in sorted({t["dataset"] for t in turns}):
        for k, branches in variants.values():
            lookup = params["decode"]["lookup"]
            proposer = PromptLookupProposer(k, lookup["max_ngram"], lookup["min_ngram"], branches)
            tokens = forwards = nodes = 0
            for turn in (t for t in turns if t["dataset"] == dataset):
                a, f, n = replay(turn, proposer, ev["max_new_tokens"])
                tokens, forwards, nodes = tokens + a, forwards + f, nodes + n
            rounds = max(forwards - sum(t["dataset"] == dataset for t in turns), 1)
            print(f"{dataset:9s} lookup k={k:<3d} branches={branches}  tau {tokens / forwards:.3f}  "
                  f"nodes/round {nodes / rounds:.2f}")


if __name__ == "__main__":
    main()
