"""The speculative decoder is lossless: greedy equals plain greedy, samples follow the target.

Greedy and KV-cache tests run the real loop with tiny random HF models. The statistical tests of every drafting
shape (chi-square against the exact law of a bigram target) are in tests/test_lossless.py; here, eq. 4's
alpha = 1 - TV on the same bigram tables.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdistill.decoding.loop as loop
from specdistill.core.models.hidden import HiddenTap
from specdistill.core.models.kv_cache import PreallocatedCache
from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.verifier import TargetVerifier
from specdistill.methods.draft.proposer import DraftLMProposer
from specdistill.methods.lookup.proposer import PromptLookupProposer

from .helpers.decoding import PROMPTS, BigramProposer, plain_greedy, tables
from .helpers.models import make_model


class BigramVerifier:
    """A target whose next-token logits depend on the last token only."""

    features = None

    def __init__(self, table: torch.Tensor):
        self.table = table

    def prefill(self, ids):
        return self.table[ids[-1]]

    def score(self, root, tree):
        nodes = tree.tokens.tolist() if tree is not None else []
        return self.table[torch.tensor([root] + nodes)]

    def commit(self, path):
        pass


# --- real (tiny) HF models --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tiny_tokenizer):
    v = len(tiny_tokenizer)
    half = make_model(v, seed=0)  # the target with a noisy head: agrees on some tokens, not all
    with torch.no_grad():
        half.lm_head.weight.add_(torch.randn(half.lm_head.weight.shape,
                                             generator=torch.Generator().manual_seed(5)) * 0.06)
    return make_model(v, seed=0), make_model(v, seed=0), make_model(v, seed=123, layers=1), half


@pytest.mark.parametrize("draft_kind", ["good", "half", "bad"])
@pytest.mark.parametrize("shape", ["chain", "tree", "lookup", "lookup_tree"])
def test_greedy_equals_plain_greedy(models, draft_kind, shape):
    target, good, bad, half = models
    draft = {"good": good, "bad": bad, "half": half}[draft_kind]
    proposer = {"chain": DraftLMProposer(draft, k=4), "tree": DraftLMProposer(draft, branching=[2, 2, 1]),
                "lookup": PromptLookupProposer(k=4), "lookup_tree": PromptLookupProposer(k=4, branches=3)}[shape]
    ver = TargetVerifier(target, capacity=128)
    for prompt in PROMPTS:
        res = speculative_generate(ver, proposer, prompt, 24, stops=set())
        assert res.tokens == plain_greedy(target, prompt, 24), (shape, draft_kind, prompt)
        if draft_kind == "good" and not shape.startswith("lookup"):
            assert res.tau > 3.0  # the target as its own draft: (almost) everything accepted


def test_lookup_tree_holds_the_latest_longest_match_first_then_other_first_tokens():
    # "0 3" at 1 (then 5 1 3), "3" also at 5 (then 2 6 0) and 2 (then 5: a repeat)
    #          0  1  2  3  4  5  6  7  8  9
    context = [7, 0, 3, 5, 1, 3, 2, 6, 0, 3]
    greedy = SamplingConfig()
    one = PromptLookupProposer(k=3, max_ngram=2).propose(context, 8, greedy, None)
    assert one.is_chain and one.tokens.tolist() == [5, 1, 3]  # branches=1: the single-chain proposer as before
    tree = PromptLookupProposer(k=3, max_ngram=2, branches=3).propose(context, 8, greedy, None)
    assert tree.tokens.tolist() == [5, 1, 3, 2, 6, 0] and tree.parents.tolist() == [-1, 0, 1, -1, 3, 4]
    assert PromptLookupProposer(k=3, max_ngram=2,
                                branches=3).propose(context, 2, greedy, None).tokens.tolist() == [5, 1, 2, 6]
    assert PromptLookupProposer(k=3, branches=2).propose([4, 5, 6], 8, greedy, None) is None  # no match: no draft
    with pytest.raises(ValueError, match="branches"):
        PromptLookupProposer(branches=0)


def test_k0_loop_is_plain_autoregressive(models):
    target = models[0]
    res = speculative_generate(TargetVerifier(target, 64), None, PROMPTS[0], 10, set())
    assert res.tokens == plain_greedy(target, PROMPTS[0], 10)
    assert res.tau == 1.0 and res.target_forwards == 10


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_kv_cache_after_partial_acceptance_equals_plain_decoding(models, shape):
    target, _, _, half = models
    proposer = DraftLMProposer(half, k=4) if shape == "chain" else DraftLMProposer(half, branching=[3, 2, 1])
    ver = TargetVerifier(target, capacity=128)
    prompt = PROMPTS[2]
    res = speculative_generate(ver, proposer, prompt, 20, set())
    assert any(0 < r.accepted < r.draft_depth for r in res.rounds)  # partial acceptance happened
    seq = prompt + res.tokens[:-1]  # the last token is emitted but not yet fed
    plain = PreallocatedCache(target.config.num_hidden_layers, 128)
    with torch.no_grad():
        target(input_ids=torch.tensor([seq]), cache=plain, use_cache=True)
    assert ver.cache.get_seq_length() == len(seq)
    for a, b in zip(ver.cache.layers, plain.layers, strict=True):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


class RecordingProposer(DraftLMProposer):
    """A draft LM that declares feature layers and records what the loop hands it."""

    feature_layers = (2, "final")

    def propose(self, context, max_depth, sampling, generator, features=None):
        self.seen.append((len(context), features))
        return super().propose(context, max_depth, sampling, generator, features)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_proposers_receive_the_target_features_of_every_committed_token(models, shape):
    """Across rounds, the features handed to a proposer are the target's hidden states of context[:-1],
    in order, each row exactly once (the state that predicted the next token): what Medusa/EAGLE read."""
    target, _, _, half = models
    proposer = RecordingProposer(half, k=4) if shape == "chain" else RecordingProposer(half, branching=[3, 2, 1])
    proposer.seen = []
    ver = TargetVerifier(target, capacity=128, feature_layers=proposer.feature_layers)
    prompt = PROMPTS[2]
    res = speculative_generate(ver, proposer, prompt, 20, set())
    assert any(0 < r.accepted < r.draft_depth for r in res.rounds)  # rejected nodes must not leak in
    got = torch.cat([f for _, f in proposer.seen])
    assert got.shape[0] == proposer.seen[-1][0] - 1  # rows for context[:-1] at the last call
    seq = (prompt + res.tokens)[: got.shape[0]]
    with HiddenTap(target, proposer.feature_layers) as tap, torch.no_grad():
        target(input_ids=torch.tensor([seq]))
    torch.testing.assert_close(got, tap.concat()[0], atol=1e-5, rtol=1e-4)
    assert got.shape[1] == 2 * target.config.hidden_size


def test_stop_tokens_and_max_new_tokens(models):
    target, good, _, _ = models
    plain = plain_greedy(target, PROMPTS[0], 30)
    stop = plain[7]
    res = speculative_generate(TargetVerifier(target, 128), DraftLMProposer(good, k=5), PROMPTS[0], 30, {stop})
    assert res.tokens == plain[: plain.index(stop) + 1]
    res = speculative_generate(TargetVerifier(target, 128), DraftLMProposer(good, k=5), PROMPTS[0], 9, set())
    assert res.tokens == plain[:9]


def test_acceptance_counts_condition_on_earlier_positions():
    r = loop.GenerationResult(tokens=[0] * 9, rounds=[
        loop.RoundStats(4, 4, 4, 5, 0, 0), loop.RoundStats(4, 4, 1, 2, 0, 0), loop.RoundStats(4, 4, 0, 1, 0, 0)])
    attempts, accepts = r.acceptance_counts(4)
    assert attempts == [3, 2, 1, 1] and accepts == [2, 1, 1, 1]
    assert r.tau == 9 / 4


def test_alpha_is_one_minus_tv_and_pinsker_bounds_it(one_thread):
    """Eq. 4 (docs/definitions.md) measured: empirical first-position acceptance equals sum min(p, q)
    = 1 - TV (TV half the L1 distance), and alpha >= 1 - sqrt(KL/2) at every drafted position."""
    target, draft = tables(3)
    g = torch.Generator().manual_seed(0)
    ver, proposer = BigramVerifier(target), BigramProposer(draft, k=2)
    exact, accepted, kls = [], [], []
    for _ in range(4000):
        res = speculative_generate(ver, proposer, [0], 3, set(), SamplingConfig(1.0), g)
        r = res.rounds[0]
        exact.append(r.alpha_exact)
        accepted.append(r.accepted >= 1)
        kls.append(r.kl)
        p, q = torch.softmax(target[res.tokens[0]].double(), -1), torch.softmax(draft[res.tokens[0]].double(), -1)
        assert abs(r.alpha_exact - (1 - 0.5 * float((p - q).abs().sum()))) < 1e-6  # float32 softmax upstream
        assert r.alpha_exact >= 1 - (r.kl / 2) ** 0.5 - 1e-12
    mean_exact, rate = float(np.mean(exact)), float(np.mean(accepted))
    assert abs(rate - mean_exact) < 4 * (mean_exact * (1 - mean_exact) / len(exact)) ** 0.5
    tally = loop_tally(exact, kls)
    assert tally["pinsker_violations"] == 0 and tally["pinsker_bound_pos1"] <= tally["alpha_exact_pos1"]


def loop_tally(exact, kls):
    from specdistill.evaluation.accounting import Tally

    t = Tally()
    t.add(1, 1.0, forwards=1, alpha_exact=exact, kl=kls)
    return t.summary()
