"""The reference trainer: vLLM's `speculators` package trains a draft beside ours, on the same data, and the engine
judges both (stages/reference.py).

- convert.py (this environment): our train split and features store in speculators' offline format;
- launch.py and shims.py (the engine's environment, which has speculators): its trainer on a CPU for an exact number
  of steps, timed, with the CUDA assumptions handled from outside.

A method takes part through its `reference` (methods/<m>/reference.py): its flags in each recipe, `matched` (our
head's architecture, loss and optimizer) and `shipped` (speculators' defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from specdistill.core.errors import ConfigError

RECIPES = ("matched", "shipped")
# our loss names -> speculators' (`--loss-fn`)
LOSSES = {"fkl": "kl_div", "rkl": "rkl", "jsd": "jsd", "tvd": "tv", "ce": "ce"}


@dataclass
class ReferenceConfig:
    dir: str            # reference@<key> writes <dir>/<key>: the checkpoint, in speculators' format
    work_dir: str       # the converted data and speculators' epoch checkpoints: a killed run resumes from them
    verifier: str       # the exported target (export_target): what the checkpoint names and the engine serves
    # reference@<key> (dvc.yaml makes one per key): `method`, a key of `methods` (its settings, its steps, its data);
    # `name`, the registered method it is (methods.<method>.name: the code folder the item watches); `recipe`,
    # matched | shipped
    items: dict[str, dict[str, str]]
    method: str | None = None  # the item this run trains
    loss_implementation: str = "eager"  # fused imports Triton (no CPU kernel)
    attn_impl: str = "sdpa"             # flex attention compiles for a GPU
    timeout_s: int = 86400
    extra_args: list[str] = field(default_factory=list)  # more `speculators train` flags, for every item
    RANGES: ClassVar[dict[str, str]] = {"timeout_s": "[1, inf)"}

    def __post_init__(self) -> None:
        for key, item in self.items.items():
            if set(item) != {"method", "name", "recipe"}:
                raise ConfigError(f"reference.items.{key}={item!r}: a map with keys method (a key of methods), name "
                                  f"(its registered method) and recipe ({' | '.join(RECIPES)})")
            if item["recipe"] not in RECIPES:
                raise ConfigError(f"reference.items.{key}.recipe={item['recipe']!r}: use one of {RECIPES}")
        if self.method is not None and self.method not in self.items:
            raise ConfigError(f"reference.method={self.method!r}: use one of {sorted(self.items)} (reference.items)")
        if self.loss_implementation not in ("eager", "fused"):
            raise ConfigError(f"reference.loss_implementation={self.loss_implementation!r}: use eager or fused")
        if self.attn_impl not in ("sdpa", "eager", "simple_flex_attention"):
            raise ConfigError(f"reference.attn_impl={self.attn_impl!r}: use sdpa, eager or simple_flex_attention")
        for own in ("--epochs", "--max-steps", "--train-data-ratio", "--data-path", "--save-path"):
            if own in self.extra_args:
                raise ConfigError(f"reference.extra_args names {own}: the stage sets it (steps are methods.<m>'s)")


def loss_fn(name: str, where: str) -> str:
    """speculators' name of our loss, or a clear error."""
    if name not in LOSSES:
        raise ConfigError(f"{where}.loss={name}: speculators' trainer has no such loss; a matched reference takes one "
                          f"of {sorted(LOSSES)}")
    return LOSSES[name]


def item_of(cfg: ReferenceConfig) -> dict[str, Any]:
    if cfg.method is None:
        raise ConfigError(f"reference.method is unset: name the item to train, one of {sorted(cfg.items)}")
    return cfg.items[cfg.method]
