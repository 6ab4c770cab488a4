"""The method registry: each speculative method is one object that says what every stage needs of it.

A stage asks the registry (`get(name, "train")`) and never names a method; adding one means its own folder
here (`methods/<m>/`, its `__init__` registering it with `register(Method(...))`, listed in `BUILT_IN`), its
`conf/methods/<m>.yaml` (how it trains), `conf/decode/<m>.yaml` (how it drafts) and its items in conf/evals,
conf/export and conf/serve, from which dvc.yaml's stages take theirs (docs/methods/adding.md). What a method may
declare (each optional; a stage refuses a method without its part, listing those that have it):

- train: `config` (its `methods.<m>` dataclass) and `build` (the Lightning module, the trained part, how to
  save it), with `label` (its name in sweep outputs), `reads_hidden` (a head on the frozen target's hidden
  states, which needs the target's own states on fixed data) and `precomputed` (it can read the features
  stage's store);
- evaluate: `decode` (its `decode.<m>` dataclass: its trained folder, its tree; a method that trains nothing, like
  suffix decoding, keeps all its settings there) and `draft`, the proposer our decoder verifies, with what the
  metrics say about it; `deterministic_branch` if it can take a branch, `companion` if it can be one (a deterministic
  tree from nothing trained, reported beside other methods or merged into their trees);
- online: `online`, the student that keeps learning while it serves, and its serving copy;
- export and serve: `export` (an engine-ready folder) and `speculative_config` (what vLLM is given), with
  `agreement_proposer` (our decoder's proposer on the same chain, for the agreement table);
- reference: `reference`, its part of a `speculators train` command, for a method speculators trains as well.

The built-in methods (`BUILT_IN`) are registered when a stage first asks for one, by importing its folder
(`methods/<m>/`: registration, model, Lightning module, proposer, export, report tables): draft (a separate small
LM), medusa, eagle (EAGLE-1, -3 and -3.1 by its settings), dflash (DSpark and XPress by its settings), lookup
(prompt lookup: ours, and the engine's when served) and suffix (suffix decoding). A method that builds on another
(DSpark and XPress on DFlash) lives in that method's folder: an item watches one method folder (dvc.yaml).

Loaded by name: a stage that asks for one method imports that method's folder only, so an edit to Medusa's
training touches no other method's items; a listing (`names`, `companions`, `all_methods`) loads them all. This
module imports no method, so a method's folder importing it is no import circle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdistill.core.errors import ConfigError

CAPABILITIES = {"train": "build", "evaluate": "draft", "online": "online", "export": "export",
                "serve": "speculative_config", "reference": "reference"}


@dataclass(frozen=True)
class TrainContext:
    """What the train stage hands a method's `build`."""

    method: Any             # its `methods.<m>` section, as its config dataclass
    size: Any               # its draft size (conf/draft/) for a method sized there, else None
    data: Any               # the distill.data section
    cfg: dict[str, Any]     # the whole composed config
    target: Any             # the loaded target (core/models/target.py)
    datamodule: Any         # the on-policy data
    stops: set[int]         # the target's stop tokens (a reduced draft vocabulary always holds them)
    pad_id: int
    module_args: dict[str, Any]  # what every method's Lightning module takes: loss, optimizer, scheduler, teacher


@dataclass(frozen=True)
class ReferenceContext:
    """What the reference stage hands a method's `reference` (speculators' own trainer on our data)."""

    recipe: str      # matched: our head's architecture and loss | shipped: speculators' defaults
    num_layers: int  # the target's decoder layers
    sequences: int   # sequences per optimizer step in our training (distill.data.batch_size)
    tokenizer: Any   # the target's
    stops: set[int]  # the target's stop tokens
    loss: str        # our loss in speculators' name (`--loss-fn`) for a matched run


@dataclass(frozen=True)
class ReferenceArgs:
    """A method's part of a `speculators train` command: the layers its draft fuses (the converted data holds these
    and the final norm's input) and its arguments (the speculator type, its architecture, its loss)."""

    aux: list[int]
    args: list[str]


@dataclass
class Built:
    """What a method's `build` returns: its Lightning module, the trained part (counted and saved), and how to
    save it (the model folder, the settings written beside it)."""

    module: Any
    student: Any
    save: Callable[[Path, dict[str, Any]], None]
    record: Callable[[], dict[str, Any]] | None = None  # what the train record holds beyond the common fields (Medusa:
    # the per-rank accuracies and the trees grown from them), read after the last validation pass


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
    # online_engine (vLLM serves while the student learns; online/engine.py): (out, the exported target's folder) ->
    # the folder the engine starts the drafter from, and the student's weights now in that checkpoint's names, less
    # what the engine's drafter shares with the target (None: this method does not learn inside the engine)
    engine_export: Callable[[Path, Path], None] | None = None
    engine_weights: Callable[[], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Method:
    name: str
    doc: str
    config: type | None = None
    build: Callable[[TrainContext], Built] | None = None
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
    deterministic_branch: Callable[[Any, Any], str | None] | None = None
    # a companion drafts deterministic trees from nothing trained (prompt lookup, suffix decoding), so evaluate can
    # report it alone beside any method in the same run (eval.beside) or verify it as a branch of one (eval.branch)
    companion: bool = False
    # online: (the online section, the target, the offline draft's folder, its decode settings) -> OnlineStudent
    online: Callable[[Any, Any, str, Any], OnlineStudent] | None = None
    online_teacher: str = "live"  # stored: the student learns from the target's stored top-k at judged positions
    export: Callable[..., None] | None = None
    # serve: (the serve section, K, the exported draft's folder) -> vLLM's `speculative_config` for it
    speculative_config: Callable[[Any, int, str | None], dict[str, Any]] | None = None
    max_k: Callable[[str], int] | None = None  # the most tokens the engine drafts with this export (None: any K)
    # serve: (the serve section, the target, K) -> our decoder's proposer on the engine's chain (the agreement table)
    agreement_proposer: Callable[[Any, Any, int], Any] | None = None
    # how the report names it: an evaluate record's settings -> (the family a user picks between, e.g. "EAGLE-3.1";
    # the run's draft in words), and a train record's settings -> (the student, what it started from)
    describe: Callable[[dict[str, Any]], tuple[str, str]] | None = None
    describe_training: Callable[[dict[str, Any]], tuple[str, str]] | None = None
    # its own tables in the report's distillation section: (the train records by run, the evaluate records) -> lines
    training_tables: Callable[[dict[str, Any], dict[str, Any]], list[str]] | None = None
    # reference (stages/reference.py): (its `methods.<m>` config, ReferenceContext) -> ReferenceArgs, for a method
    # vLLM's speculators package trains too, so its own trainer runs beside ours on the same data
    reference: Callable[[Any, ReferenceContext], ReferenceArgs] | None = None


REGISTRY: dict[str, Method] = {}

# registered name -> the folder under specdistill/methods/ whose __init__ registers it
BUILT_IN = {"draft": "draft", "medusa": "medusa", "eagle": "eagle", "dflash": "dflash",
            "lookup": "lookup", "suffix": "suffix"}


def find(name: str) -> Method | None:
    """The method registered as `name` (its built-in folder imported first), None for an unknown name."""
    if name not in REGISTRY and name in BUILT_IN:
        importlib.import_module(f"specdistill.methods.{BUILT_IN[name]}")
    return REGISTRY.get(name)


def all_methods() -> dict[str, Method]:
    """Every registered method, the built-ins loaded."""
    for name in BUILT_IN:
        find(name)
    return REGISTRY


def register(method: Method) -> Method:
    if method.name in REGISTRY:
        raise ValueError(f"method {method.name!r} is registered twice")
    REGISTRY[method.name] = method
    return method


def names(capability: str) -> tuple[str, ...]:
    """The registered methods that have `capability` (train, evaluate, online, export, serve)."""
    attr = CAPABILITIES[capability]
    return tuple(n for n, m in all_methods().items() if getattr(m, attr) is not None)


def companions() -> tuple[str, ...]:
    """The registered companions: what eval.beside and eval.branch may name."""
    return tuple(n for n, m in all_methods().items() if m.companion and m.draft is not None)


def describe(metrics: dict[str, Any]) -> tuple[str, str]:
    """(family, the draft in words) of an evaluate record, from its method's `describe` (its name where it has none)."""
    method = find(metrics["method"])
    if method is None or method.describe is None:
        return metrics["method"], metrics["method"]
    return method.describe(metrics["settings"])


def describe_training(settings: dict[str, Any]) -> tuple[str, str]:
    """(student, what it started from) of a train record, from its method's `describe_training`."""
    method = find(trained_method(settings))
    if method is None or method.describe_training is None:
        return settings["method"].get("name", "?"), "–"
    return method.describe_training(settings)


def training_tables(runs: dict[str, dict[str, Any]], evaluated: dict[str, dict[str, Any]]) -> list[str]:
    """The tables of each method that trained a run and has its own (`Method.training_tables`), once per method
    module (EAGLE-3 and EAGLE-1 share theirs), in the registry's order."""
    trained = {trained_method(r["settings"]) for r in runs.values()}
    lines: list[str] = []
    done: set[Any] = set()
    for name in BUILT_IN:
        method = find(name)
        if name in trained and method.training_tables is not None and method.training_tables not in done:
            done.add(method.training_tables)
            lines += method.training_tables(runs, evaluated)
    return lines


def trained_method(settings: dict[str, Any]) -> str:
    """The method a train record's settings name (records from before methods were named are the separate draft's)."""
    return settings["method"].get("name", "draft")


def decode_settings(cfg: dict[str, Any], name: str, over: dict[str, Any] | None = None) -> Any:
    """How method `name` drafts: its `decode.<name>` section with `over` (an evaluate item's or the online
    stage's `decode` keys) set over it, as its `decode` dataclass, checked like any section (a wrong key or type
    is named). None for a method with no decode settings. A method without a section (a config built by hand)
    takes the dataclass's defaults, which tests/test_config_defaults.py proves are conf/decode/<name>.yaml's."""
    from specdistill.core.config import section

    method = find(name)
    if method is None:
        raise ConfigError(f"decode.{name}: no method is registered as {name!r}; use one of {sorted(all_methods())}")
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
        key = f"{where}.items.{name}.{'ours' if where == 'serve' else 'model'}"
        raise ConfigError(f"{key} is not set: give the folder train@{name} writes (e.g. {key}=models/{name})")
    return str(folder)


def get(name: str, capability: str, key: str = "method") -> Method:
    """The method `name`, which must have `capability`; an error naming the config key and the choices."""
    method = find(name)
    if method is None or getattr(method, CAPABILITIES[capability]) is None:
        raise ConfigError(f"{key}={name!r}: use one of {names(capability)}"
                          + ("" if method is None else f" ({name} has no {capability} part)"))
    return method
