"""Suffix decoding (methods/suffix/): its matches and trees against brute force, its settings through the registry
and the config, and the decoder staying lossless with it (greedy equality here; the chi-square in test_lossless)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdistill import methods
from specdistill.core.errors import ConfigError
from specdistill.decoding.protocols import SamplingConfig
from specdistill.methods.suffix import (
    SuffixConfig,
    SuffixIndex,
    SuffixProposer,
    context_match,
    frequency_tree,
    load_answers,
)

tokens = st.lists(st.integers(0, 3), min_size=0, max_size=30)  # a small alphabet: many repeats


def brute_index_match(answers: list[list[int]], context: list[int], longest: int) -> tuple[int, Counter]:
    """The longest suffix of `context` (<= longest) occurring in any answer, and where its occurrences end."""
    for p in range(min(longest, len(context)), 0, -1):
        pat = context[-p:]
        ends = Counter((a, i + p) for a, ans in enumerate(answers)
                       for i in range(len(ans) - p + 1) if ans[i:i + p] == pat)
        if ends:
            return p, ends
    return 0, Counter()


@given(st.lists(tokens, min_size=1, max_size=5), tokens, st.integers(1, 8))
def test_the_index_finds_the_longest_suffix_and_every_occurrence(answers, context, longest):
    index = SuffixIndex(answers, width=8)
    p, after = index.longest_match(context, longest)
    want_p, want_ends = brute_index_match(answers, context, longest)
    assert p == want_p
    # positions in the joined index (answers separated by END) back to (answer, offset)
    starts = [0]
    for ans in answers:
        starts.append(starts[-1] + len(ans) + 1)
    got = Counter()
    for a in after:
        k = max(i for i, s in enumerate(starts) if s <= a)
        got[(k, a - starts[k])] += 1
    assert got == (want_ends if p else Counter())


@given(tokens, st.integers(1, 10))
def test_the_context_match_is_the_longest_earlier_suffix(context, longest):
    p, after = context_match(context, longest)
    n = len(context)
    want = 0
    for j in range(n - 1):  # an earlier end j: the longest m with context[j-m+1..j] == context[n-m..n-1]
        m = 0
        while m < min(longest, j + 1) and context[j - m] == context[n - 1 - m]:
            m += 1
        want = max(want, m)
    assert p == want
    assert sorted(after) == sorted(j + 1 for j in range(n - 1) if want and
                                   context[j - want + 1:j + 1] == context[n - want:])


def test_the_tree_takes_the_most_frequent_paths_first_within_its_budget():
    conts = [[4, 5], [4, 5], [4, 6], [9, 1]]
    tree = frequency_tree(conts, budget=3, min_prob=0.1)
    # 4: 3/4; 4->5: 3/4 * 2/3 = 1/2; 9: 1/4; 4->6: 1/4; 9->1: 1/4 (ties: the first found)
    assert tree.tokens.tolist() == [4, 5, 9] and tree.parents.tolist() == [-1, 0, -1]
    assert frequency_tree(conts, budget=8, min_prob=0.3).tokens.tolist() == [4, 5]
    assert frequency_tree([], budget=8, min_prob=0.1) is None


@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), min_size=1, max_size=12),
       st.integers(1, 10), st.floats(0, 1))
def test_every_tree_is_prefix_closed_in_order_and_within_its_limits(conts, budget, min_prob):
    tree = frequency_tree(conts, budget, min_prob)
    if tree is None:
        return
    assert len(tree) <= budget
    paths = []
    for tok, parent in zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True):
        assert parent < len(paths)  # its parent came first
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
    assert len(set(paths)) == len(paths)  # siblings differ
    assert all(any(c[:len(p)] == list(p) for c in conts) for p in paths)  # every path was seen


def test_the_draft_grows_with_the_match_and_stops_at_the_depth_it_is_given():
    proposer = SuffixProposer(SuffixConfig(max_spec_tokens=8, max_spec_factor=1.0),
                              SuffixIndex([[1, 2, 3, 4, 5, 6, 7]], 24))
    greedy = SamplingConfig()
    assert proposer.propose([9, 1], 10, greedy, None).tokens.tolist() == [2]  # a 1-token match drafts 1
    assert proposer.propose([1, 2, 3], 10, greedy, None).tokens.tolist() == [4, 5, 6]
    assert proposer.propose([1, 2, 3], 2, greedy, None).tokens.tolist() == [4, 5]
    assert proposer.propose([8, 8, 0], 10, greedy, None) is None  # nothing matched, nothing drafted
    # the request's own context wins a tie with the index (it is the more specific source)
    assert proposer.propose([1, 2, 9, 1, 2], 10, greedy, None).tokens.tolist() == [9, 1]


def test_its_settings_come_from_decode_suffix_and_are_checked_at_start(tmp_path):
    assert "suffix" in methods.names("evaluate") and "suffix" not in methods.names("train")
    own = methods.decode_settings({"decode": {"suffix": {"corpus": None, "max_spec_tokens": 4}}}, "suffix")
    assert isinstance(own, SuffixConfig) and own.max_spec_tokens == 4 and own.corpus is None
    over = methods.decode_settings({"decode": {"suffix": {"corpus": None}}}, "suffix", {"max_spec_tokens": 2})
    assert over.max_spec_tokens == 2  # an evaluate item's keys over the section
    with pytest.raises(ConfigError, match=r"decode.suffix.max_spec_tokens"):
        methods.decode_settings({"decode": {"suffix": {"max_spec_tokens": "many"}}}, "suffix")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['max_spec'\] in `decode.suffix`"):
        methods.decode_settings({"decode": {"suffix": {}}}, "suffix", {"max_spec": 2})
    assert methods.decode_settings({}, "suffix") == SuffixConfig()  # no section (built by hand): the defaults
    with pytest.raises(ConfigError, match=r"run the generate stage"):
        load_answers(tmp_path, "train")


def test_greedy_output_is_the_targets_whatever_the_index_holds(target):
    """Lossless at T=0: the index holds the target's own greedy answers (drafts accepted) and random ones (drafts
    rejected); the output is plain greedy's either way, and the good index saves target forwards."""
    import torch

    from specdistill.decoding.loop import speculative_generate
    from specdistill.decoding.verifier import TargetVerifier

    from .helpers.decoding import PROMPTS, plain_greedy

    greedy = [plain_greedy(target, p, 24) for p in PROMPTS]
    noise = torch.randint(3, target.config.vocab_size, (6, 20), generator=torch.Generator().manual_seed(0)).tolist()
    for answers, saves in ((greedy, True), (noise, False)):
        proposer = SuffixProposer(SuffixConfig(), SuffixIndex(answers, 24))
        for prompt, want in zip(PROMPTS, greedy, strict=True):
            res = speculative_generate(TargetVerifier(target, capacity=128), proposer, prompt, 24, stops=set())
            assert res.tokens == want
            if saves:
                assert res.tau > 2.0, res.tau


def test_evaluate_stage_runs_suffix_decoding_over_a_generated_corpus(tmp_path, tiny_target_dir, monkeypatch):
    from specdistill.core.records import read_record
    from specdistill.stages import evaluate as evaluate_stage

    from .helpers.data import save_mtbench, write_split

    save_mtbench(tmp_path / "prompts", ("Hi",))
    write_split(tmp_path / "generated/train", rows=8, seed=0, vocab=60)
    monkeypatch.chdir(tmp_path)
    cfg = {"paths": {"prompts_dir": str(tmp_path / "prompts")}, "logger": {"enabled": False},
           "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32"},
           "decode": {"suffix": {"corpus": str(tmp_path / "generated"), "max_spec_tokens": 4}},
           "eval": {"method": "suffix", "datasets": ["mtbench"], "num_prompts": 1, "max_new_tokens": 8,
                    "temperatures": [0.0, 1.0], "hf_baselines": False}}
    evaluate_stage.run(cfg)
    record = read_record(tmp_path / "metrics/suffix.json")
    assert record["settings"]["suffix"]["max_spec_tokens"] == 4 and record["settings"]["corpus_tokens"] > 0
    assert set(record["results"]["mtbench"]) == {"T0", "T1"}
    cfg["decode"]["suffix"]["max_spec_tokens"] = 0  # out of range: refused before the target loads
    cfg["target"]["name_or_path"] = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"decode.suffix.max_spec_tokens=0"):
        evaluate_stage.run(cfg)
