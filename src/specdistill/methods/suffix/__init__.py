"""Suffix decoding (Oliaro et al., 2024, arXiv 2411.04975): drafts with no model. The longest suffix of the context
that occurred before, in this request or in the target's earlier answers, is matched, and the continuations that
followed it become a draft tree of the most frequent paths, its size adapted to the match length (a long match
is a confident one). Nothing to train: its "model" is an index over the on-policy answers the generate stage
wrote (data/generated), which are what this target says to prompts like these.

The paper's global tree grows with every answer served. Here the index is fixed at the stage's start: the
evaluation runs each prompt at two temperatures, and an answer indexed at T=0 would be copied at T=1.
The settings are vLLM's suffix-decoding knobs, under the same names: `max_tree_depth`, `max_spec_factor`,
`min_token_prob`, and `max_spec_tokens` for its `num_speculative_tokens`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from specdistill.core.errors import ConfigError
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.tree import DraftTree
from specdistill.methods import Drafting, Method, register

log = logging.getLogger(__name__)
END = -1  # between two answers in the index: no token equals it, so no match runs across answers


@dataclass
class SuffixConfig:
    """decode.suffix (conf/decode/suffix.yaml)."""

    corpus: str | None = None  # a generate stage's folder (its <split>/shard-* answers are indexed); null: none,
    # only the request's own context (prompt lookup with frequency-ranked trees)
    corpus_split: str = "train"
    max_tree_depth: int = 24  # tokens matched + drafted: the longest suffix matched is this minus the draft's depth
    max_spec_tokens: int = 8  # nodes per draft tree
    max_spec_factor: float = 1.0  # nodes <= factor x the match length: a short match drafts little
    min_token_prob: float = 0.1  # a node joins the tree when its path's estimated probability is at least this
    max_occurrences: int = 256  # earlier occurrences of the matched suffix counted per draft (the corpus's first)
    RANGES: ClassVar[dict[str, str]] = {"max_tree_depth": "[2, 256]", "max_spec_tokens": "[1, 64]",
                                        "max_spec_factor": "(0, inf)", "min_token_prob": "[0, 1]",
                                        "max_occurrences": "[1, inf)"}


class SuffixIndex:
    """Every suffix of a token sequence, sorted (a suffix array compared on its first `width` tokens), so the
    occurrences of any pattern of at most `width` tokens are one range found by binary search."""

    def __init__(self, answers: list[list[int]], width: int):
        self.tokens: list[int] = []
        for answer in answers:
            self.tokens.extend(answer)
            self.tokens.append(END)
        self.width = width
        toks = self.tokens
        self.order = sorted((i for i in range(len(toks)) if toks[i] != END), key=lambda i: toks[i:i + width])

    def occurrences(self, pattern: list[int]) -> range:
        """The range of `order` holding the start positions of `pattern` (at most `width` tokens)."""
        n, toks = len(pattern), self.tokens
        lo = bisect.bisect_left(self.order, pattern, key=lambda i: toks[i:i + n])
        return range(lo, bisect.bisect_right(self.order, pattern, key=lambda i: toks[i:i + n], lo=lo))

    def longest_match(self, context: list[int], longest: int) -> tuple[int, list[int]]:
        """(p, positions right after each occurrence) for the longest suffix of `context` of at most `longest`
        tokens that occurs here; a suffix that occurs has every shorter one occurring, so p is found by bisection."""
        lo, hi, found = 0, min(longest, len(context), self.width), range(0)
        while lo < hi:  # each step only bisects; the positions are listed once, for the length found
            mid = (lo + hi + 1) // 2
            starts = self.occurrences(context[-mid:])
            if starts:
                lo, found = mid, starts
            else:
                hi = mid - 1
        return lo, [self.order[k] + lo for k in found]


def context_match(context: list[int], longest: int) -> tuple[int, list[int]]:
    """(p, positions right after each earlier occurrence) of the longest suffix of `context` (at most `longest`
    tokens) that also ends earlier in it. Only positions holding the last token can end one, so the scan
    extends backwards from those alone."""
    n, last = len(context), context[-1] if context else None
    best, after = 0, []
    for j in range(n - 2, -1, -1):
        if context[j] != last:
            continue
        m = 1
        while m < longest and j - m >= 0 and context[j - m] == context[n - 1 - m]:
            m += 1
        if m > best:
            best, after = m, [j + 1]
        elif m == best:
            after.append(j + 1)
    return best, after


def frequency_tree(continuations: list[list[int]], budget: int, min_prob: float) -> DraftTree | None:
    """The draft tree of the most probable paths through `continuations` (each the tokens that followed one
    occurrence): a path's probability is the product, along it, of the share of the continuations through a
    node that go on to each child. Nodes are taken best-first, so the tree holds the `budget` most probable
    paths of probability >= min_prob and every node's parent comes before it."""
    trie: dict[tuple[int, ...], dict[int, int]] = {}  # path -> {next token: continuations through it}
    for cont in continuations:
        for d in range(len(cont)):
            children = trie.setdefault(tuple(cont[:d]), {})
            children[cont[d]] = children.get(cont[d], 0) + 1
    tokens: list[int] = []
    parents: list[int] = []
    order = itertools.count()  # ties: the path found first (children in descending count, then token id)
    frontier = [(-1.0, next(order), (), -1)]  # (-probability, tie, path, the node index of its parent)
    while frontier:
        neg, _, path, parent = heapq.heappop(frontier)
        node = -1
        if path:  # the root (the empty path) is the context itself, not a node
            node = len(tokens)
            tokens.append(path[-1])
            parents.append(parent)
            if len(tokens) == budget:
                break
        children = trie.get(path, {})
        total = sum(children.values())
        for tok, count in sorted(children.items(), key=lambda kv: (-kv[1], kv[0])):
            if -neg * count / total >= min_prob:
                heapq.heappush(frontier, (neg * count / total, next(order), (*path, tok), node))
    if not tokens:
        return None
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


class SuffixProposer:
    """Drafts from whichever source matched the longer suffix: the request's own context (ties: it is the more
    specific) or the index of earlier answers. Deterministic drafts, so the verifier's rule keeps it lossless at
    any temperature."""

    feature_layers = ()

    def __init__(self, scfg: SuffixConfig, index: SuffixIndex | None):
        self.cfg, self.index = scfg, index

    def reset(self) -> None:
        pass

    def propose(self, context: list[int], max_depth: int, sampling: SamplingConfig,
                generator: torch.Generator | None, features: torch.Tensor | None = None) -> DraftTree | None:
        c = self.cfg
        longest = c.max_tree_depth - 1
        p, after = context_match(context, longest)
        source = context
        if self.index is not None:
            q, found = self.index.longest_match(context, longest)
            if q > p:
                p, after, source = q, found, self.index.tokens
        if p == 0:
            return None
        budget = min(c.max_spec_tokens, math.ceil(c.max_spec_factor * p))
        depth = min(budget, max_depth, c.max_tree_depth - p)
        if depth < 1:
            return None
        conts = []
        for a in after[:c.max_occurrences]:
            cont = source[a:a + depth]
            if END in cont:
                cont = cont[:cont.index(END)]
            if cont:
                conts.append(cont)
        return frequency_tree(conts, budget, c.min_token_prob)


def load_answers(folder: Path, split: str) -> list[list[int]]:
    """The response tokens of every answer in a generate stage's split (prompt tokens left out: the index holds
    what the target said)."""
    from specdistill.core.data.datamodule import load_split

    shards = sorted(p for p in (folder / split).glob("shard-*") if p.is_dir())
    if not shards:
        raise ConfigError(f"decode.suffix.corpus={folder}: no {split}/shard-* there; run the generate stage "
                          "(dvc repro generate) or set decode.suffix.corpus=null (the request's own context only)")
    answers = []
    for shard in shards:
        ds = load_split(shard)
        if ds is not None:
            answers += [ids[plen:] for ids, plen in zip(ds["input_ids"], ds["prompt_len"], strict=True)]
    return answers


def drafting(ecfg: Any, target: Any, scfg: SuffixConfig) -> Drafting:
    index = None
    if scfg.corpus:
        answers = load_answers(Path(scfg.corpus), scfg.corpus_split)
        index = SuffixIndex(answers, scfg.max_tree_depth)
        log.info("suffix index: %d answers, %d tokens (%s/%s)", len(answers), len(index.order), scfg.corpus,
                 scfg.corpus_split)
    info = {"suffix": dict(vars(scfg)),
            "corpus_tokens": len(index.order) if index else 0}
    return Drafting(SuffixProposer(scfg, index), info, max_depth=scfg.max_spec_tokens)


def describe(s: dict[str, Any]) -> tuple[str, str]:
    own = s.get("suffix") or {}
    return "suffix decoding", ("suffix decoding, " + ("the context and the target's answers" if own.get("corpus")
                                                      else "the context alone")
                               + f", trees of {own.get('max_spec_tokens', '?')} nodes")


register(Method("suffix", __doc__, decode=SuffixConfig, draft=drafting, describe=describe, companion=True))
