"""Prompt lookup (Saxena, 2023): drafts copied from the context where its last n-gram occurred before; nothing to
train. Ours at evaluate (a companion: a row beside any method, or a branch of its tree, decoding/union.py); served, the
engine's (vLLM's `method: ngram`) with ours beside it on the same chain."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from specdistill.core.errors import ConfigError
from specdistill.methods import Drafting, Method, register


@dataclass
class LookupDecode:
    """decode.lookup (conf/decode/lookup.yaml)."""

    k: int = 8  # tokens drafted after the latest earlier match of the context's last n-gram
    max_ngram: int = 3  # longest n-gram tried first
    min_ngram: int = 1
    branches: int = 1  # sibling chains: older matches and shorter n-grams (methods/draft/proposer.py); 1: one chain
    RANGES: ClassVar[dict[str, str]] = {"k": "[1, 64]", "max_ngram": "[1, inf)", "min_ngram": "[1, inf)",
                                        "branches": "[1, 64]"}

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"decode.lookup: need 1 <= min_ngram ({self.min_ngram}) <= max_ngram "
                              f"({self.max_ngram})")


def lookup_proposer(dec: LookupDecode) -> Any:
    from specdistill.methods.lookup.proposer import PromptLookupProposer

    return PromptLookupProposer(dec.k, dec.max_ngram, dec.min_ngram, dec.branches)


def drafting(eval_cfg: Any, target: Any, dec: LookupDecode) -> Drafting:
    return Drafting(lookup_proposer(dec), {"lookup": asdict(dec)}, max_depth=dec.k)


def speculative_config(serve_cfg: Any, k: int, draft_dir: str | None) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": serve_cfg.ngram_max,
            "prompt_lookup_min": serve_cfg.ngram_min}


def agreement_proposer(serve_cfg: Any, target: Any, k: int) -> Any:
    from specdistill.methods.lookup.proposer import PromptLookupProposer

    return PromptLookupProposer(k, serve_cfg.ngram_max, serve_cfg.ngram_min, 1)


def describe(s: dict[str, Any]) -> tuple[str, str]:
    # decode.lookup as the run recorded it; records written before it carry eval.lookup_k / eval.lookup_branches
    own = s.get("lookup") or {"k": s.get("lookup_k"), "branches": s.get("lookup_branches", 1)}
    branches, k = own.get("branches", 1), own.get("k")
    return "prompt lookup", ("prompt lookup" + (f", a tree of {branches} chains" if branches > 1 else "")
                             + (f", K={k}" if k else ""))


register(Method("lookup", __doc__, decode=LookupDecode, draft=drafting, describe=describe, companion=True,
                speculative_config=speculative_config, agreement_proposer=agreement_proposer))
