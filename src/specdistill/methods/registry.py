"""The registry itself: what a method declares (`Method`), `register`, and the lookups the stages make.

Method modules import this module (never the package), so registering is no import circle."""


from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdistill.errors import ConfigError

CAPABILITIES = {"train": "build", "evaluate": "draft", "online": "online", "export": "export", "serve": "engine"}


@dataclass
class Built:
    """What a method's `build` returns: its Lightning module, the trained part (counted and saved), and how to
    save it (the model folder, the settings written beside it)."""

    module: Any
    student: Any
    save: Callable[[Path, dict[str, Any]], None]


@dataclass
class Drafting:
    """What a method's `draft` returns to the evaluate stage: the proposer our decoder verifies, what the
    metrics record about the draft, and the deepest position it drafts."""

    proposer: Any
    info: dict[str, Any] = field(default_factory=dict)
    max_depth: int = 0
    assistant: Any = None  # an HF model that HF assisted generation can run beside ours (full vocabulary only)


@dataclass
class OnlineStudent:
    """What a method's `online` returns: the Lightning module around the float32 student, the proposer over a
    serving copy in the target's dtype, and how to save a deployed version."""

    module: Any
    proposer: Any
    student: Any
    serving: Any
    save: Callable[[Path, int], None]
    replay: Callable[[Any], Any] | None = None  # loss -> a module with a live teacher sharing the student, for
    # replaying offline batches (None: the module's own teacher is live already)


@dataclass(frozen=True)
class Method:
    name: str
    doc: str
    config: type | None = None
    build: Callable[..., Built] | None = None
    label: Callable[[Any, Any], str] | None = None
    reads_hidden: bool = False
    precomputed: bool = False
    draft_size: type | None = None  # the dataclass of `methods.<m>.draft` (conf/draft/), for a method sized there
    check: Callable[[Any], None] | None = None  # its own checks of its training config, before the target loads
    # how it drafts at evaluation: the dataclass of its `decode.<m>` section (conf/decode/<m>.yaml; its trained
    # folder, its tree), parsed with an item's keys over it by `decode_settings`
    decode: type | None = None
    # evaluate: (the eval section, the target, its decode settings) -> Drafting
    draft: Callable[[Any, Any, Any], Drafting] | None = None
    # evaluate's branch (eval.branch: a companion's tree and this method's verified as one, decoding/union.py):
    # None when the method takes no branch; else (the eval section, its decode settings) -> the setting that makes
    # its draft deterministic when it would sample a chain, or None when it is
    sampled_chain: Callable[[Any, Any], str | None] | None = None
    # a companion drafts deterministic trees from nothing trained (prompt lookup, suffix decoding), so evaluate can
    # report it alone beside any method in the same run (eval.beside) or verify it as a branch of one (eval.branch)
    companion: bool = False
    # online: (the online section, the target, the offline draft's folder, its decode settings) -> OnlineStudent
    online: Callable[[Any, Any, str, Any], OnlineStudent] | None = None
    online_teacher: str = "live"  # stored: the student learns from the target's stored top-k at judged positions
    export: Callable[..., None] | None = None
    engine: Callable[[Any, int, str | None], dict[str, Any]] | None = None
    max_k: Callable[[str], int] | None = None  # the most tokens the engine drafts with this export (None: any K)
    ours: Callable[[Any, Any, int], Any] | None = None
    # how the report names it: an evaluate record's settings -> (the family a user picks between, e.g. "EAGLE-3.1";
    # the run's draft in words), and a train record's settings -> (the student, what it started from)
    describe: Callable[[dict[str, Any]], tuple[str, str]] | None = None
    describe_training: Callable[[dict[str, Any]], tuple[str, str]] | None = None


REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in REGISTRY:
        raise ValueError(f"method {method.name!r} is registered twice")
    REGISTRY[method.name] = method
    return method


def names(capability: str) -> tuple[str, ...]:
    """The registered methods that have `capability` (train, evaluate, online, export, serve)."""
    attr = CAPABILITIES[capability]
    return tuple(n for n, m in REGISTRY.items() if getattr(m, attr) is not None)


def companions() -> tuple[str, ...]:
    """The registered companions: what eval.beside and eval.branch may name."""
    return tuple(n for n, m in REGISTRY.items() if m.companion and m.draft is not None)


def describe(metrics: dict[str, Any]) -> tuple[str, str]:
    """(family, the draft in words) of an evaluate record, from its method's `describe` (its name where it has none)."""
    method = REGISTRY.get(metrics["method"])
    if method is None or method.describe is None:
        return metrics["method"], metrics["method"]
    return method.describe(metrics["settings"])


def describe_training(settings: dict[str, Any]) -> tuple[str, str]:
    """(student, what it started from) of a train record, from its method's `describe_training`."""
    method = REGISTRY.get(settings["method"].get("name", "draft"))
    if method is None or method.describe_training is None:
        return settings["method"].get("name", "?"), "–"
    return method.describe_training(settings)


def decode_settings(cfg: dict[str, Any], name: str, over: dict[str, Any] | None = None) -> Any:
    """How method `name` drafts: its `decode.<name>` section with `over` (an evaluate item's or the online
    stage's `decode` keys) set over it, as its `decode` dataclass, checked like any section (a wrong key or type
    is named). None for a method with no decode settings. A method without a section (a config built by hand)
    takes the dataclass's defaults, which tests/test_config_defaults.py proves are conf/decode/<name>.yaml's."""
    from specdistill.config import section

    method = REGISTRY[name]
    if method.decode is None:
        if over:
            raise ConfigError(f"decode keys {sorted(over)} were set for method={name}, which has no decode settings")
        return None
    values = (cfg.get("decode") or {}).get(name) or {}
    return section(method.decode, merged(values, over or {}), f"decode.{name}")


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` set key by key over `base`, nested sections too (an item's `tree: {top_k: 2}` keeps the tree's
    other keys), as Hydra merges configs."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.merge(base, over))


def trained_folder(stage_cfg: Any, name: str, where: str) -> str:
    """The trained folder of method `name` that a stage's `models` map names (export: what it exports; serve: what
    our decoder runs beside the engine)."""
    folder = (getattr(stage_cfg, "models", None) or {}).get(name)
    if not folder:
        raise ConfigError(f"{where}.models.{name} is not set: give the folder train@{name} writes "
                          f"(e.g. {where}.models.{name}=models/{name})")
    return str(folder)


def get(name: str, capability: str, key: str = "method") -> Method:
    """The method `name`, which must have `capability`; an error naming the config key and the choices."""
    method = REGISTRY.get(name)
    if method is None or getattr(method, CAPABILITIES[capability]) is None:
        raise ConfigError(f"{key}={name!r}: use one of {names(capability)}"
                          + ("" if method is None else f" ({name} has no {capability} part)"))
    return method
