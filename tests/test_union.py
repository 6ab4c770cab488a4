"""Union of drafts (decoding/union.py): the merged tree, greedy equality and losslessness of EAGLE + prompt lookup."""

from __future__ import annotations

import pytest
import torch

from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.tree import DraftTree
from specdistill.decoding.union import UnionProposer, merge
from specdistill.decoding.verifier import TargetVerifier
from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig
from specdistill.methods.lookup.proposer import PromptLookupProposer
from specdistill.methods.medusa.proposer import MedusaProposer
from specdistill.methods.medusa.tree import grow_tree

from .helpers.decoding import V, plain_greedy, tree_paths
from .helpers.drafts import random_head, random_heads
from .helpers.evaluate import eagle_eval_config, greedy_texts


def test_merge_is_the_union_of_the_trees_paths():
    a = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 0]))  # 5 -> {7, 8}; 6
    b = DraftTree.chain([5, 7, 9, 1])  # shares 5 -> 7, then goes on
    c = DraftTree.chain([6, 6])
    u = merge([a, b, c])
    assert tree_paths(u) == tree_paths(a) | tree_paths(b) | tree_paths(c)
    assert len(u) == len(tree_paths(u))  # one node per path: siblings are distinct
    assert torch.equal(u.tokens[:4], a.tokens) and torch.equal(u.parents[:4], a.parents)  # the first tree stays put
    assert u.q is None and len(merge([b, b])) == 4


def test_merge_refuses_sampled_drafts():
    sampled = DraftTree.chain([1, 2], torch.full((2, V), 1.0 / V))
    with pytest.raises(ValueError, match="deterministic"):
        merge([DraftTree.chain([1]), sampled])


class _Fixed:
    feature_layers = ()

    def __init__(self, tree, layers=()):
        self.tree, self.feature_layers, self.seen = tree, layers, []

    def reset(self):
        pass

    def propose(self, context, max_depth, sampling, generator, features=None):
        self.seen.append(features)
        return self.tree


def test_union_proposer_passes_features_to_every_member_and_drops_empty_drafts():
    eagle_like, lookup_like = _Fixed(DraftTree.chain([3, 4]), layers=(1, 2)), _Fixed(None)
    u = UnionProposer(eagle_like, lookup_like)
    assert u.feature_layers == (1, 2)
    feats = torch.ones(2, 4)
    assert u.propose([1, 2], 4, SamplingConfig(), None, feats) is eagle_like.tree  # one draft: returned as is
    assert eagle_like.seen[0] is feats and lookup_like.seen[0] is feats
    assert UnionProposer(_Fixed(None), _Fixed(DraftTree.empty())).propose([1], 4, SamplingConfig(), None) is None
    with pytest.raises(ValueError, match="different target states"):
        UnionProposer(_Fixed(None, (1,)), _Fixed(None, (2,)))


REPEATING = [[1, 5, 9, 13, 5, 9, 13, 5], [1, 77, 3, 12, 77, 3, 12, 77, 3], [1, 200, 201, 202, 200, 201]]


def test_greedy_eagle_plus_lookup_equals_plain_greedy(target):
    head = random_head(target, "eagle3", torch.arange(0, target.config.vocab_size, 2))
    tree = EagleTreeConfig(shape="dynamic", depth=3, top_k=2, total_tokens=5)
    eagle = EagleProposer(head, tree, capacity=128)
    union = UnionProposer(EagleProposer(head, tree, capacity=128), PromptLookupProposer(k=4))
    ver = TargetVerifier(target, capacity=128, feature_layers=union.feature_layers)
    grew = 0
    for prompt in REPEATING:
        res = speculative_generate(ver, union, prompt, 24, stops=set())
        alone = speculative_generate(ver, eagle, prompt, 24, stops=set())
        assert res.tokens == plain_greedy(target, prompt, 24) == alone.tokens, prompt
        grew += sum(r.draft_len > 5 for r in res.rounds)  # rounds where the lookup branch added nodes
        assert all(r.draft_len <= 5 + 4 for r in res.rounds)
    assert grew > 0  # the prompts repeat themselves, so lookup must have drafted


def test_greedy_medusa_plus_lookup_equals_plain_greedy(target):
    """The branch is not EAGLE's alone: Medusa's fixed tree (it reads the final state) merges with lookup too
    (benchmarks/lookup_branch.py's m: variants)."""
    choices = grow_tree([[0.5, 0.2, 0.1]] * 3, 6)
    union = UnionProposer(MedusaProposer(random_heads(target, 3), choices), PromptLookupProposer(k=4))
    assert union.feature_layers == ("final",)
    ver = TargetVerifier(target, capacity=128, feature_layers=union.feature_layers)
    grew = 0
    for prompt in REPEATING:
        res = speculative_generate(ver, union, prompt, 24, stops=set())
        assert res.tokens == plain_greedy(target, prompt, 24), prompt
        grew += sum(r.draft_len > 6 for r in res.rounds)
    assert grew > 0


def test_evaluate_stage_runs_eagle_with_a_lookup_branch(tmp_path, tiny_target_dir, monkeypatch):
    from specdistill.core.errors import ConfigError
    from specdistill.stages import evaluate as evaluate_stage
    cfg = eagle_eval_config(tmp_path, tiny_target_dir, monkeypatch, name="eagle_lookup", branch="lookup",
                            hf_baselines=False)
    cfg["decode"]["lookup"]["branches"] = 2
    metrics = evaluate_stage.run(cfg)
    assert metrics["settings"]["branch"] == "lookup" and metrics["settings"]["lookup"]["branches"] == 2
    assert set(metrics["results"]["mtbench"]["T0"]) == {"ar", "spec"}  # a branch is no row of its own
    t0 = greedy_texts(tmp_path / "plots/eagle_lookup/samples.jsonl")
    assert t0[(1, "spec")] == t0[(1, "ar")] and t0[(2, "spec")] == t0[(2, "ar")]
    bad = [({"method": "lookup"}, {}, "method=lookup takes no branch"),
           ({"branch": "eagle"}, {}, r"eval.branch: 'eagle' is not a companion: use one of \('lookup', 'suffix'\)"),
           ({"beside": ["draft"]}, {}, r"eval.beside: 'draft' is not a companion"),
           ({"decode": {"tree": {"shape": "chain"}}}, {}, r"method=eagle drafts a chain by sampling.*shape=dynamic"),
           ({"method": "draft"}, {}, r"method=draft drafts a chain by sampling.*eval.tree"),
           ({}, {"min_ngram": 4}, r"decode.lookup: need 1 <= min_ngram \(4\) <= max_ngram \(3\)"),
           ({}, {"branches": 0}, r"decode\.lookup\.branches=0`: must be in \[1, 64\]")]
    for change, lookup, message in bad:
        with pytest.raises(ConfigError, match=message):
            evaluate_stage.run({**cfg, "eval": {**cfg["eval"], **change},
                                "decode": {**cfg["decode"], "lookup": {**cfg["decode"]["lookup"], **lookup}}})


def test_evaluate_stage_runs_a_separate_draft_with_a_lookup_branch(tmp_path, tiny_target_dir, monkeypatch):
    """The branch is not EAGLE's: a draft LM's top-k tree (here the target's first layers, untrained) merges too."""
    from specdistill.stages import evaluate as evaluate_stage
    cfg = eagle_eval_config(tmp_path, tiny_target_dir, monkeypatch, name="draft_lookup", method="draft", tree=[2, 2],
                            branch="lookup", hf_baselines=False)
    metrics = evaluate_stage.run(cfg)
    assert metrics["settings"]["branch"] == "lookup" and metrics["method"] == "draft"
    t0 = greedy_texts(tmp_path / "plots/draft_lookup/samples.jsonl")
    assert t0[(1, "spec")] == t0[(1, "ar")] and t0[(2, "spec")] == t0[(2, "ar")]


def test_any_companion_is_a_branch_or_a_row_beside(tmp_path, tiny_target_dir, monkeypatch):
    """Suffix decoding as EAGLE's branch, with prompt lookup and suffix decoding each reported alone beside it: the
    companions are config, not code (eval.branch, eval.beside); every row writes the target's greedy text."""
    from specdistill.reporting.summary import family
    from specdistill.reporting.tables import draft_label, results_table
    from specdistill.stages import evaluate as evaluate_stage
    cfg = eagle_eval_config(tmp_path, tiny_target_dir, monkeypatch, name="eagle_suffix", branch="suffix",
                            beside=["lookup", "suffix"], hf_baselines=False)
    cfg["decode"]["suffix"] = {"corpus": None, "max_spec_tokens": 4}  # the request's own context
    metrics = evaluate_stage.run(cfg)
    s = metrics["settings"]
    assert s["branch"] == "suffix" and s["suffix"]["max_spec_tokens"] == 4 and s["lookup"]["k"] == 4
    assert set(metrics["results"]["mtbench"]["T0"]) == {"ar", "spec", "lookup", "suffix"}
    t0 = greedy_texts(tmp_path / "plots/eagle_suffix/samples.jsonl")
    assert all(t0[(turn, m)] == t0[(turn, "ar")] for turn in (1, 2) for m in ("spec", "lookup", "suffix"))
    assert family(metrics) == "EAGLE-3 + suffix decoding branch"
    assert draft_label(metrics)[0].startswith("eagle3, dynamic tree 5 nodes + suffix decoding, the context alone")
    table = "\n".join(results_table({"eagle_suffix": metrics}, "mtbench", "T0"))
    assert "| prompt lookup, K=4 (ours) |" in table
    assert "| suffix decoding, the context alone, trees of 4 nodes (ours) |" in table


def test_a_lookup_branch_is_allowed_wherever_the_methods_draft_is_deterministic():
    from specdistill import methods
    from specdistill.core.errors import ConfigError
    from specdistill.stages.evaluate import EvalConfig, check_branch

    def check(method: str, decode: dict | None = None, **eval_keys) -> None:
        check_branch(EvalConfig(method=method, branch="lookup", **eval_keys),
                     methods.decode_settings({}, method, decode))

    check("draft", temperatures=[0.0])  # a greedy chain
    check("draft", tree=[2, 2], temperatures=[0.0, 1.0])  # a top-k tree
    check("medusa", temperatures=[0.0, 1.0])  # Medusa's tree is top-ranked tokens
    check("eagle", {"tree": {"shape": "chain"}}, temperatures=[0.0])
    check("dflash", {"branching": [2, 1]}, temperatures=[0.0, 1.0])  # a tree of each slot's top tokens
    with pytest.raises(ConfigError, match="method=draft drafts a chain by sampling"):
        check("draft", temperatures=[1.0])
    with pytest.raises(ConfigError, match=r"method=dflash drafts a chain by sampling.*decode.dflash.branching"):
        check("dflash", temperatures=[1.0])


def test_prompt_lookups_own_item_keys_reach_its_record(tmp_path, tiny_target_dir, monkeypatch):
    """method=lookup with an item's decode keys: the draft, the positions counted and the record all use them (the
    record once showed decode.lookup's section, not the item's)."""
    from specdistill.core.records import read_record
    from specdistill.stages import evaluate as evaluate_stage
    cfg = eagle_eval_config(tmp_path, tiny_target_dir, monkeypatch, name="lookup", method="lookup",
                            hf_baselines=False, temperatures=[0.0], decode={"k": 10, "branches": 2})
    evaluate_stage.run(cfg)
    settings = read_record(tmp_path / "metrics/lookup.json")["settings"]
    assert settings["lookup"]["k"] == 10 and settings["lookup"]["branches"] == 2 and settings["decode"]["k"] == 10
