"""The decoder is lossless: every proposer's output follows the target's own law, against an exact reference.

The target is a bigram table over 8 tokens (its next-token law depends on the last token only), so the
law of the n-th generated token is exact: the first token's warped distribution times the warped
transition matrix n-1 times (`exact_marginals`). Each proposer drafts from unrelated random weights, so
most drafts are partly rejected and the residual rule carries the result. Checked for the first drafted
token (position 1; position 0 comes from the prefill) and the fifth (position 4), at T=1 (every shape) and at
T=0.7 / top-p 0.9 (where the warp can meet the rule differently: `WARPED`), with a Pearson chi-square over draws
from fixed seeds (deterministic: a pass stays a pass), drawn in four seeded chunks over the cores.

The sizes come from the test's power (tests/helpers/stats.py), not from its wall time. A position's law q that
differs from the exact p by total variation TV has Cohen's w >= 2 TV, and the chi-square over V = 8 tokens
(df 7) at ALPHA = 1e-3 rejects it with probability POWER = 0.9 once draws * w^2 >= 31.8. So:

| tier | draws | every deviation caught (power 0.9, alpha 1e-3 per position) |
|---|---|---|
| `make test` | 4,973 | TV >= 0.04 (4 points of probability moved from some tokens to others) |
| `make test-full` | 35,362 | TV >= 0.015 |

The control breaks the rule (no residual after a rejection). Measured (`pytest -s -k broken`), every shape's
broken law lies at w = 0.15-0.37 from the target's at position 1 (dflash_chain the least), where the main size
detects w >= 0.08; by position 4 the chain has mixed most of it away. CONTROL_DRAWS = 3,050 catch w = 0.15 with
power 0.99 at 1e-6, the threshold the control asserts, and each control also asserts that the law it caught is
one the main size catches (its w above that size's smallest).

This file is the lossless suite of every drafting shape; the method files test their drafts' other properties.
Run with `-s` to see the p-values and effect sizes; `make test-fast` leaves out the costly cases (`COSTLY`, marker
lossless_full).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

import specdistill.decoding.loop as loop
from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.union import UnionProposer
from specdistill.decoding.verify import verify_sampling
from specdistill.evaluation.autotune import Capped
from specdistill.methods.dflash.proposer import DFlashProposer
from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig
from specdistill.methods.lookup.proposer import PromptLookupProposer
from specdistill.methods.medusa.model import MedusaConfig, MedusaHeads
from specdistill.methods.medusa.proposer import MedusaProposer
from specdistill.methods.suffix import SuffixConfig, SuffixIndex, SuffixProposer

from .helpers.decoding import BigramProposer, FeatureBigramVerifier, V, exact_marginals, tables
from .helpers.drafts import bigram_drafter, bigram_head
from .helpers.stats import chi2_p, draws_to_detect, effect_size, smallest_detected_tv

PROMPT = [0, 3, 5, 1, 3, 2, 0, 3]  # repeats, so prompt lookup drafts too
NEW, POSITIONS = 5, (1, 4)
ALPHA, POWER = 1e-3, 0.9  # per position; a fixed seed makes a pass stay a pass
TV, TV_FULL = 0.04, 0.015  # the smallest deviation caught, `make test` and `make test-full`
CONTROL_W, CONTROL_ALPHA, CONTROL_POWER = 0.15, 1e-6, 0.99  # the broken rules' smallest effect (measured, w)
CONTROL_DRAWS = int(np.ceil(draws_to_detect(CONTROL_W / 2, V, CONTROL_ALPHA, CONTROL_POWER) / 50) * 50)  # w = 2 TV
CHUNKS = 4  # the draws in 4 seeded chunks, spread over the cores (the `pool` fixture)


def medusa_heads() -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=V, vocab_size=V))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 2)
    return heads.eval()


PROPOSERS = {  # every drafting shape the decoder verifies
    "chain": lambda draft: BigramProposer(draft, k=3),
    "topk_tree": lambda draft: BigramProposer(draft, branching=[3, 2]),
    "iid_tree": lambda draft: BigramProposer(draft, branching=[2, 2], iid=True),  # siblings drawn i.i.d. from q
    "pruned_tree": lambda draft: Capped(BigramProposer(draft, branching=[3, 2]), None, width=2),  # eval.width
    "eagle_chain": lambda draft: EagleProposer(  # a chain sampled from the head's q
        bigram_head(), EagleTreeConfig(shape="chain", k=3), capacity=64),
    "eagle_static": lambda draft: EagleProposer(bigram_head(), EagleTreeConfig(shape="static", branching=[3, 2, 1]),
                                                capacity=64),
    "eagle_dynamic": lambda draft: EagleProposer(
        bigram_head(), EagleTreeConfig(shape="dynamic", depth=3, top_k=2, total_tokens=5), capacity=64),
    "dflash_chain": lambda draft: DFlashProposer(bigram_drafter(block=4)),  # each slot sampled from its own q
    "dflash_tree": lambda draft: DFlashProposer(bigram_drafter(block=4), branching=[2, 2]),  # each slot's top tokens
    # DSpark: the block with a Markov head, q_j given the draw before it; a tree whose nodes' children differ
    "dspark_chain": lambda draft: DFlashProposer(bigram_drafter(block=4, markov_rank=3)),
    "dspark_tree": lambda draft: DFlashProposer(bigram_drafter(block=4, markov_rank=3), branching=[2, 2]),
    # XPress: the block with a causal refiner, q_j given every draw before it in the block; each node its own path
    "xpress_chain": lambda draft: DFlashProposer(bigram_drafter(block=4, refiner_rank=2)),
    "xpress_tree": lambda draft: DFlashProposer(bigram_drafter(block=4, refiner_rank=2), branching=[2, 2]),
    "medusa": lambda draft: MedusaProposer(medusa_heads(), [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]),
    "union": lambda draft: UnionProposer(  # lookup's one chain (decode.lookup.branches: 1, evaluate@eagle_lookup)
        EagleProposer(bigram_head(), EagleTreeConfig(shape="dynamic", depth=2, top_k=2, total_tokens=3), capacity=64),
        PromptLookupProposer(k=3)),
    "union_branches": lambda draft: UnionProposer(  # two sibling lookup chains
        EagleProposer(bigram_head(), EagleTreeConfig(shape="dynamic", depth=2, top_k=2, total_tokens=3), capacity=64),
        PromptLookupProposer(k=3, branches=2)),
    # deterministic frequency trees from an index of earlier answers (and the context's own repeats)
    "suffix": lambda draft: SuffixProposer(SuffixConfig(max_spec_tokens=4, max_tree_depth=6), SuffixIndex(
        torch.randint(0, V, (12, 24), generator=torch.Generator().manual_seed(0)).tolist(), 6)),
}
SAMPLINGS = {"T1": SamplingConfig(1.0), "T0.7-p0.9": SamplingConfig(0.7, top_p=0.9)}
# Every shape at T = 1; the warped setting where the draft's own q enters the rule (a sampled chain, block or
# i.i.d. tree: q must be warped as p is) and on a top-k tree and EAGLE's, where only the target's p is warped. The
# other deterministic trees meet the warp in the same code (the loop warps p for every shape; verify_sampling reads
# no q for them), so a warped draw of each would check nothing new.
WARPED = ("chain", "topk_tree", "iid_tree", "eagle_chain", "eagle_dynamic", "dflash_chain", "dspark_chain",
          "xpress_chain")
# what costs a minute or more a case on 2 cores (an EAGLE head's layer per drafted level, or the warped draws):
# `make test` runs it, `make test-fast` leaves it out (marker lossless_full); every shape's T = 1 case that is left
# runs in both
COSTLY = ("eagle_chain", "eagle_static", "eagle_dynamic", "union", "union_branches")
pytestmark = pytest.mark.lossless
CASES = [pytest.param(shape, sampling, id=f"{shape}-{sampling}",
                      marks=[pytest.mark.lossless_full] if shape in COSTLY or sampling != "T1" else [])
         for shape in PROPOSERS for sampling in SAMPLINGS if sampling == "T1" or shape in WARPED]
CONTROLS = [pytest.param(shape, marks=[pytest.mark.lossless_full] if shape in COSTLY else []) for shape in PROPOSERS]


def draws_of(shape: str, sampling: str, seed: int, draws: int, broken: bool = False) -> np.ndarray:
    """`draws` generations from one seeded generator (in a pool worker: nothing but names crosses the process)."""
    torch.set_num_threads(1)  # thousands of ops on 8-entry tensors: a thread hand-off costs more than the work
    if broken:  # the control: no residual after a rejection
        loop.verify_sampling = functools.partial(verify_sampling, skip_residual=True)
    try:
        table, draft = tables()
        proposer, gen = PROPOSERS[shape](draft), torch.Generator().manual_seed(seed)
        return np.array([speculative_generate(FeatureBigramVerifier(table), proposer, PROMPT, NEW, set(),
                                              SAMPLINGS[sampling], gen).tokens
                         for _ in range(draws)])
    finally:
        loop.verify_sampling = verify_sampling


@pytest.fixture(scope="module")
def pool():
    """One process per core for the whole module: the draws are pure Python-side work, one core each. Chunks are
    seeded by their index, so the result is the same for any number of cores."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process whose torch has started threads
    with ProcessPoolExecutor(max_workers=max(1, min(CHUNKS, os.cpu_count() or 1)), mp_context=ctx) as ex:
        yield ex


def drawn(pool, shape: str, sampling: str, draws: int, seed: int = 1,
          broken: bool = False) -> tuple[np.ndarray, list[torch.Tensor]]:
    """`draws` generations and the exact law of each position."""
    sizes = [draws // CHUNKS + (i < draws % CHUNKS) for i in range(CHUNKS)]
    parts = pool.map(draws_of, [shape] * CHUNKS, [sampling] * CHUNKS, [seed * 1000 + i for i in range(CHUNKS)],
                     sizes, [broken] * CHUNKS)
    table, _ = tables()
    return np.concatenate(list(parts)), exact_marginals(table, table[PROMPT[-1]], SAMPLINGS[sampling], NEW)


@pytest.mark.parametrize(("shape", "sampling"), CASES)
def test_first_and_fifth_token_follow_the_target(pool, full_tier, shape, sampling):
    tv = TV_FULL if full_tier else TV
    out, exact = drawn(pool, shape, sampling, draws_to_detect(tv, V, ALPHA, POWER))
    p = {pos: chi2_p(out[:, pos], exact[pos]) for pos in POSITIONS}
    print(f"\nlossless {shape:13s} {sampling:9s} {len(out)} draws (TV >= {tv} caught) "
          + "  ".join(f"p(pos {k})={v:.3f}" for k, v in p.items()))
    assert min(p.values()) > ALPHA, p


@pytest.mark.parametrize("shape", CONTROLS)
def test_the_suite_catches_a_broken_rule(pool, shape):
    out, exact = drawn(pool, shape, "T1", CONTROL_DRAWS, broken=True)
    p = {pos: chi2_p(out[:, pos], exact[pos]) for pos in POSITIONS}
    w = {pos: effect_size(out[:, pos], exact[pos]) for pos in POSITIONS}
    print(f"\nbroken rule {shape:13s} " + "  ".join(f"p(pos {k})={v:.2e} w={w[k]:.3f}" for k, v in p.items()))
    assert min(p.values()) < CONTROL_ALPHA, p
    # the broken law is one the main size catches too: its deviation above the smallest that size detects
    assert max(w.values()) >= 2 * smallest_detected_tv(draws_to_detect(TV, V, ALPHA, POWER), V, ALPHA, POWER), w


def test_the_sizes_stated_above_are_the_ones_computed():
    for n in (draws_to_detect(TV, V, ALPHA, POWER), draws_to_detect(TV_FULL, V, ALPHA, POWER), CONTROL_DRAWS):
        assert f"{n:,}" in __doc__, n


def test_the_sizes_catch_the_deviation_they_promise():
    """The power calculation against simulation: laws at the smallest w the size set for TV detects (random
    directions around the exact law of position 1) are rejected at ALPHA about POWER of the time, and each lies at
    TV <= w / 2 from it, so a law at TV or more is at least as far."""
    rng = np.random.default_rng(0)
    table, _ = tables()
    p = exact_marginals(table, table[PROMPT[-1]], SAMPLINGS["T1"], NEW)[1].numpy()
    n, trials, rejected = draws_to_detect(TV, V, ALPHA, POWER), 400, 0
    w = 2 * smallest_detected_tv(n, V, ALPHA, POWER)
    for _ in range(trials):
        d = rng.standard_normal(V) * p
        d -= p * d.sum()  # a direction that keeps the total at 1
        d *= w / np.sqrt((d**2 / p).sum())
        q = np.clip(p + d, 0, None)
        assert np.abs(q - p).sum() / 2 <= w / 2 + 1e-9
        rejected += chi2_p(rng.choice(V, n, p=q / q.sum()), p) < ALPHA
    assert abs(rejected / trials - POWER) < 0.05, rejected / trials
