"""eval.depth=auto: the prediction from measured costs and a pilot, the caps, and the evaluate stage's choice."""

from __future__ import annotations

import pytest
import torch

from specdistill.core.errors import ConfigError
from specdistill.core.records import read_record
from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.tree import DraftTree
from specdistill.decoding.verifier import TargetVerifier
from specdistill.evaluation.autotune import Capped, Pilot, Round, chain_tree, choose, predict, verify_seconds
from specdistill.methods.draft.proposer import DraftLMProposer
from specdistill.stages import evaluate as evaluate_stage

from .helpers.models import make_model


def pilot(accepted, draft_s, nodes):
    return Pilot([Round.chain(nodes, a, draft_s) for a in accepted])


def test_tau_is_one_plus_the_chained_acceptance_and_the_cost_is_draft_plus_verification():
    deep = pilot([0, 1, 2, 3], draft_s=0.3, nodes=3)  # a chain of 3: rounds accepting 0, 1, 2 and 3 tokens
    shallow = pilot([0, 1], draft_s=0.1, nodes=1)
    verify = {0: 1.0, 1: 1.0, 2: 1.1, 3: 1.2}
    p = predict(deep, shallow, 3, verify)
    assert list(p) == ["0", "1", "2", "3"]  # a chain has one width: no "2w1"
    # P(A >= 1) = 3/4, P(A >= 2) = 2/4, P(A >= 3) = 1/4: tau(1) = 1.75, tau(2) = 2.25, tau(3) = 2.5
    assert [round(p[d]["tau"], 6) for d in "0123"] == [1.0, 1.75, 2.25, 2.5]
    # draft seconds linear in depth between the pilots (0.1 at 1, 0.3 at 3); a chain of 3 capped at 2 verifies 2
    assert p["2"]["nodes"] == 2 and p["2"]["round_s"] == pytest.approx(0.2 + 1.1)
    assert p["3"]["speedup"] == pytest.approx(2.5 * 1.0 / (0.3 + 1.2)) and p["0"]["speedup"] == 1.0


def test_cheap_verification_chooses_deep_and_costly_verification_chooses_plain_ar():
    deep, shallow = pilot([0, 1, 2, 3, 3, 2], 0.02, 3), pilot([0, 1, 1], 0.01, 1)
    fast = predict(deep, shallow, 3, {0: 1.0, 1: 1.0, 3: 1.02})  # a native-bf16 CPU: verifying 3 nodes ~ free
    assert max(fast, key=lambda d: fast[d]["speedup"]) == "3"
    weak = pilot([0, 0, 0, 1, 0, 0], 0.3, 3)  # a weak draft on a CPU where every node costs (AVX2, bf16 emulated)
    slow = predict(weak, pilot([0, 0, 1], 0.1, 1), 3, {0: 1.0, 1: 1.9, 3: 3.5})
    assert max(slow, key=lambda d: slow[d]["speedup"]) == "0" and all(slow[d]["speedup"] < 1 for d in "123")


def test_the_choice_is_the_cheapest_shape_within_one_standard_error_of_the_best():
    # 6 rounds of a chain of 3; only one round reached the third token, so depth 3 leads depth 2 by less than the
    # error of that gap: depth 2, the cheaper, is chosen
    deep, shallow = pilot([0, 1, 2, 2, 2, 3], 0.02, 3), pilot([0, 1, 1], 0.01, 1)
    p = predict(deep, shallow, 3, {0: 1.0, 1: 1.0, 3: 1.02})
    assert max(p, key=lambda d: p[d]["speedup"]) == "3" and p["3"]["speedup_se"] > 0 and p["0"]["speedup_se"] == 0
    assert [d for d in p if p[d]["best"]] == ["3"]  # the shape the gaps were taken to, marked for `choose`
    assert p["3"]["speedup"] - p["2"]["speedup"] <= p["2"]["se_vs_best"] < p["3"]["speedup"] - p["1"]["speedup"]
    assert choose(p) == "2"
    # the same acceptance over 60 times the rounds: the error shrinks below the gaps and the best is chosen
    many = predict(pilot([0, 1, 2, 2, 2, 3] * 60, 0.02, 3), shallow, 3, {0: 1.0, 1: 1.0, 3: 1.02})
    assert choose(many) == "3"
    # a draft whose best barely clears AR, within its own error: plain AR, the cheapest shape
    weak = predict(pilot([0, 0, 0, 2, 0, 0], 0.01, 3), pilot([0, 0, 1], 0.01, 1), 3, {0: 1.0, 1: 1.0, 3: 1.02})
    assert max(weak[d]["speedup"] for d in weak) > 1 and choose(weak) == "0"


def test_choose_takes_the_gaps_to_the_shape_predict_marked_best_not_a_max_over_rounded_figures():
    # rounded to 5 digits, depths 2 and 3 tie; the pilot's unrounded best was 3, and every se_vs_best is to it
    pred = {"0": {"speedup": 1.0, "round_s": 1.0, "se_vs_best": 0.01, "best": False},
            "2": {"speedup": 1.2, "round_s": 1.1, "se_vs_best": 0.0, "best": False},
            "3": {"speedup": 1.2, "round_s": 1.2, "se_vs_best": 0.0, "best": True}}
    assert choose(pred) == "2"  # within 0 of the marked best: the cheaper
    pred["2"]["speedup"] = 1.19  # now 0.01 behind the marked best, with no error: out
    assert choose(pred) == "3"
    # a record without the mark: the max (ties: the first)
    assert choose({k: {f: v for f, v in p.items() if f != "best"} for k, p in pred.items()}) == "3"


def test_the_gap_to_the_best_is_judged_by_its_own_paired_error_not_the_best_shapes_error():
    # rounds accepting 0..3 tokens: depths 2 and 3 differ in two rounds only, so their gap is known far better than
    # either speed-up; the best's own error (what the rule used before) would have kept depth 2
    p = predict(pilot([0, 1, 2, 3, 3, 2], 0.02, 3), pilot([0, 1, 1], 0.01, 1), 3, {0: 1.0, 1: 1.0, 3: 1.02})
    gap = p["3"]["speedup"] - p["2"]["speedup"]
    assert p["2"]["se_vs_best"] < gap <= p["3"]["speedup_se"] and choose(p) == "3"
    assert p["0"]["se_vs_best"] == pytest.approx(p["3"]["speedup_se"]) and p["3"]["se_vs_best"] == 0  # AR: exact
    # a record from before the paired error: every gap against the best's own error
    old = {k: {f: x for f, x in v.items() if f != "se_vs_best"} for k, v in p.items()}
    assert choose(old) == "2"


def binary(depth):
    """A full binary tree of `depth` levels, each node's likelier child first (index order)."""
    parents, level = [], [-1]
    for _ in range(depth):
        nxt = []
        for p in level:
            parents += [p, p]
            nxt += [len(parents) - 2, len(parents) - 1]
        level = nxt
    return DraftTree(torch.arange(len(parents)), torch.tensor(parents))


def test_a_round_knows_what_each_pruned_tree_would_have_kept():
    tree = binary(3)  # 2 + 4 + 8 nodes
    assert tree.reach.tolist()[:6] == [0, 1, 0, 1, 1, 1]  # node 4 is node 1's first child: reach 1 via its parent
    kept = [0, 3, 8]  # first child, then its second child (3), then that one's first child (8): reach 0, 1, 1
    rnd = Round(0.0, tree.depth.tolist(), tree.reach.tolist(), [tree.reach.tolist()[i] for i in kept])
    assert rnd.accepted(3, None) == 3 and rnd.accepted(2, None) == 2  # the whole tree, capped in depth
    assert rnd.accepted(3, 1) == 1  # the chain of first children stops where the path took a second child
    assert rnd.nodes(3, 1) == 3 and rnd.nodes(2, None) == 6 and rnd.nodes(3, None) == 14
    # and what is predicted is what the pruned tree holds
    assert len(tree.prune(width=1)) == 3 and tree.prune(width=1).is_chain and len(tree.prune(2)) == 6


def test_where_nodes_cost_a_chain_of_the_tree_beats_the_tree_and_where_they_are_free_the_tree_wins():
    tree = binary(2)  # 2 + 4 nodes; rounds keep: nothing; twice the first children; the second child, its first
    reach = tree.reach.tolist()
    rounds = [Round(0.01, tree.depth.tolist(), reach, [reach[i] for i in kept])
              for kept in ([], [0, 2], [0, 2], [1, 4])]
    deep = Pilot(rounds)
    assert deep.widest == 2
    free = predict(deep, deep, 2, {0: 1.0, 2: 1.0, 6: 1.0})
    assert set(free) == {"0", "1w1", "1", "2w1", "2"} and max(free, key=lambda k: free[k]["speedup"]) == "2"
    assert free["2"]["tau"] == pytest.approx(1 + 6 / 4) and free["2w1"]["tau"] == pytest.approx(1 + 4 / 4)
    costly = predict(deep, deep, 2, {0: 1.0, 2: 1.2, 6: 3.0})  # verification grows with every node (AVX2)
    best = max(costly, key=lambda k: costly[k]["speedup"])
    assert best == "2w1" and costly["2w1"]["nodes"] == 2 and costly["2"]["speedup"] < 1 < costly["2w1"]["speedup"]


def test_the_pilot_must_have_run():
    with pytest.raises(ValueError, match="no round"):
        predict(Pilot(), Pilot(), 2, {0: 1.0})


def test_a_capped_draft_stays_lossless_and_depth_zero_is_ar(tiny_tokenizer):
    target, draft = make_model(len(tiny_tokenizer), seed=0), make_model(len(tiny_tokenizer), seed=1)
    prompt, stops = [5, 6, 7, 8], {tiny_tokenizer.eos_token_id}
    ar = speculative_generate(TargetVerifier(target, 256), None, prompt, 16, stops)
    for depth in (0, 1, 2):
        res = speculative_generate(TargetVerifier(target, 256), Capped(DraftLMProposer(draft, k=4), depth),
                                   prompt, 16, stops, SamplingConfig())
        assert res.tokens == ar.tokens  # greedy: the target's own chain at every cap
        assert max((r.draft_depth for r in res.rounds), default=0) <= depth
        assert depth or not any(r.draft_len for r in res.rounds)
    for width in (1, 2):  # eval.width: the first `width` children of each node of a top-k tree
        res = speculative_generate(TargetVerifier(target, 256),
                                   Capped(DraftLMProposer(draft, branching=[3, 2]), None, width), prompt, 16, stops)
        assert res.tokens == ar.tokens
        assert all(r.draft_len <= width + width * width for r in res.rounds) and any(r.draft_len for r in res.rounds)
        assert width > 1 or all(r.draft_len == r.draft_depth for r in res.rounds)  # width 1: a chain


def test_verification_seconds_are_measured_per_node_count(tiny_model):
    out = verify_seconds(TargetVerifier(tiny_model, 256), list(range(3, 40)), [0, 1, 4], vocab=100, repeats=2)
    assert set(out) == {0, 1, 4} and all(s > 0 for s in out.values())
    assert chain_tree(3, 100).parents.tolist() == [-1, 0, 1]


def stage_config(tmp_path, target_dir, monkeypatch, **eval_keys):
    """An evaluate stage's config over three MT-bench prompts (test and dev) and the tiny target, in tmp_path."""
    from .helpers.data import save_questions

    save_questions(tmp_path / "prompts", ["Write a poem.", "What is Paris?", "Name a colour."])
    monkeypatch.chdir(tmp_path)
    return {"paths": {"prompts_dir": str(tmp_path / "prompts")}, "logger": {"enabled": False},
            "target": {"name_or_path": str(target_dir), "dtype": "float32"},
            "decode": {"draft": {"path": None, "layers": 1}},
            "eval": {"method": "draft", "datasets": ["mtbench"], "max_new_tokens": 8, "hf_baselines": False,
                     "depth": "auto", **eval_keys}}


def test_the_evaluate_stage_chooses_the_depth_it_predicts_best_on_dev_prompts(tmp_path, tiny_target_dir, monkeypatch):
    cfg = stage_config(tmp_path, tiny_target_dir, monkeypatch, k=3, num_prompts=2, temperatures=[0.0, 1.0])
    metrics = evaluate_stage.run(cfg)
    auto = read_record(tmp_path / "metrics/draft.json")["settings"]["auto_depth"]
    pred = {int(d): p["speedup"] for d, p in auto["predicted"].items()}
    assert sorted(pred) == [0, 1, 2, 3] and auto["choice"] == choose(auto["predicted"]) == str(auto["depth"])
    assert auto["predicted"][auto["best_predicted"]]["best"] is True and auto["rule"] == "one standard error"
    assert pred[int(auto["best_predicted"])] == max(pred.values())
    assert auto["pilot_prompts"] == 1 and auto["verify_s"]["0"] > 0 and auto["pilot_rounds"] > 0
    m = metrics["results"]["mtbench"]["T0"]["spec"]
    assert all(f"alpha_pos{k}" not in m for k in range(auto["depth"] + 1, 5))  # nothing drafted past the cap
    cfg["eval"]["depth"] = "deep"
    with pytest.raises(ConfigError, match="eval.depth='deep'"):
        evaluate_stage.run(cfg)


def test_for_a_tree_the_stage_chooses_a_width_too_and_decodes_with_it(tmp_path, tiny_target_dir, monkeypatch):
    cfg = stage_config(tmp_path, tiny_target_dir, monkeypatch, tree=[3, 2], num_prompts=1, temperatures=[0.0])
    evaluate_stage.run(cfg)
    auto = read_record(tmp_path / "metrics/draft.json")["settings"]["auto_depth"]
    pred = auto["predicted"]
    assert {"0", "1w1", "1w2", "1", "2w1", "2w2", "2"} <= set(pred)  # every depth at every width below 3
    assert auto["choice"] == choose(pred)
    assert (pred[auto["choice"]]["depth"], pred[auto["choice"]]["width"]) == (auto["depth"], auto["width"])
    assert pred["2w1"]["nodes"] <= 2 and pred["2"]["nodes"] > pred["2w2"]["nodes"]  # 3 + 6 nodes against 2 + 4
    cfg["eval"]["width"] = 1
    with pytest.raises(ConfigError, match="eval.depth=auto chooses the width too"):
        evaluate_stage.run(cfg)
