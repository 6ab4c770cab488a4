"""The keys every `methods.<m>` section has: a light module (no Lightning), so the stages that only read a
method's config (evaluate, export, serve, report) do not import the training stack."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class MethodConfigBase:
    """The keys every `methods.<m>` section has; a method's config adds its own (keyword-only, so a
    subclass may add fields without defaults' order mattering)."""

    init_from: str | None = None  # a saved draft/heads folder to start from (continue, or validate with max_steps=0)
    trainer: dict[str, Any] = field(default_factory=dict)  # over the `trainer` section for this method only
    # the folder train@<m> waits for besides the generated answers (dvc.yaml's item reads it): the features store
    # for a head that reads it (teacher: precomputed), the prompts for a run on the source's own answers
    inputs: str = "data/generated"
