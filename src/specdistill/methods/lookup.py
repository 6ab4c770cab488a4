"""Prompt lookup (Saxena, 2023): drafts copied from the context where its last n-gram occurred before; nothing to
train. `lookup` is ours (evaluate; also a branch beside any draft, decoding/union.py), `ngram` the engine's."""

from __future__ import annotations

from typing import Any

from specdistill.methods.registry import Drafting, Method, register


def proposer(ecfg: Any) -> Any:
    from specdistill.decoding.proposers import PromptLookupProposer

    return PromptLookupProposer(ecfg.lookup_k, ecfg.lookup_max_ngram, ecfg.lookup_min_ngram, ecfg.lookup_branches)


def drafting(ecfg: Any, target: Any, own: Any = None) -> Drafting:
    return Drafting(proposer(ecfg), {}, max_depth=0, lookup_branch=False)


def engine(scfg: Any, k: int, draft_dir: str | None) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": scfg.ngram_max,
            "prompt_lookup_min": scfg.ngram_min}


def ours(scfg: Any, target: Any, k: int) -> Any:
    from specdistill.decoding.proposers import PromptLookupProposer

    return PromptLookupProposer(k, scfg.ngram_max, scfg.ngram_min, 1)


def describe(s: dict[str, Any]) -> tuple[str, str]:
    branches = s.get("lookup_branches", 1)
    return "prompt lookup", "prompt lookup" + (f", a tree of {branches} chains" if branches > 1 else "")


register(Method("lookup", __doc__, draft=drafting, describe=describe))
register(Method("ngram", "The engine's prompt lookup (vLLM `method: ngram`), with ours beside it.", engine=engine,
                ours=ours))
