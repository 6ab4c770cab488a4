"""One source of config: conf/ holds the defaults. A config dataclass validates a section's types and ranges; where
it carries a default too (for code and tests that build one by hand), that default is conf/'s, proven here for
every field of every section the stages read."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from .helpers.config import composed


def sections() -> list[tuple[str, type, dict[str, Any]]]:
    from specdistill import methods
    from specdistill.core.assets import AssetsConfig
    from specdistill.core.data.datamodule import DataConfig
    from specdistill.core.data.features import FeaturesConfig
    from specdistill.core.data.generation import GenerateConfig
    from specdistill.core.data.prompts import PrepareConfig, SourceConfig
    from specdistill.core.models.target import TargetConfig
    from specdistill.engine.serving import ServeConfig
    from specdistill.methods.draft.model import DraftSize
    from specdistill.methods.eagle.proposer import EagleTreeConfig
    from specdistill.online.policy import OnlineConfig
    from specdistill.stages.evaluate import EvalConfig
    from specdistill.stages.export import ExportConfig
    from specdistill.stages.train import DistillConfig, LossConfig

    cfg = composed("~experiment")  # the sections' own files: an experiment changes a run, not a default
    out = [("assets", AssetsConfig, cfg["assets"]), ("distill", DistillConfig, cfg["distill"]),
           ("distill.data", DataConfig, cfg["distill"]["data"]), ("features", FeaturesConfig, cfg["features"]),
           ("generate", GenerateConfig, cfg["generate"]), ("data", PrepareConfig, cfg["data"]),
           ("data.source", SourceConfig, cfg["data"]["source"]), ("serve", ServeConfig, cfg["serve"]),
           # the model's own names (which file, which commit) are the target file's, never a dataclass's
           ("target", TargetConfig, {k: v for k, v in cfg["target"].items() if k not in ("name_or_path", "gguf_file")}),
           ("online", OnlineConfig, cfg["online"]),
           ("eval", EvalConfig, cfg["eval"]), ("decode.eagle.tree", EagleTreeConfig, cfg["decode"]["eagle"]["tree"]),
           ("export", ExportConfig, cfg["export"])]
    out += [(f"decode.{name}", m.decode, cfg["decode"][name]) for name, m in methods.all_methods().items() if m.decode]
    for key, m in cfg["methods"].items():
        method = methods.find(m["name"])
        if key != m["name"] or _default({f.name: f for f in dataclasses.fields(method.config)}["name"]) != key:
            continue  # a variant (draft_ce, eagle31; eagle1 of EAGLE-3's class) differs from its base by design
        out.append((f"methods.{key}", method.config, m))
        out.append((f"methods.{key}.loss", LossConfig, m["loss"]))
        if "draft" in m:
            out.append((f"methods.{key}.draft", DraftSize, m["draft"]))
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def interpolated() -> set[str]:
    """Dotted keys whose conf/ value comes from another section at compose time (`${seed}`,
    `${paths.models_dir}/eagle`): a dataclass cannot repeat those, and carries None or its own."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from .helpers.project import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        raw = OmegaConf.to_container(compose("config", overrides=["~experiment"]), resolve=False)
    out: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, str) and "${" in v:
                out.add(f"{prefix}{k}")
    walk(raw, "")
    return out


INTERPOLATED = interpolated()


@pytest.mark.parametrize("where,cls,values", sections(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_dataclass_default_is_the_one_in_conf(where, cls, values):
    differ = {}
    for f in dataclasses.fields(cls):
        d = _default(f)
        if d is dataclasses.MISSING or f.name not in values or f"{where}.{f.name}" in INTERPOLATED \
                or isinstance(values[f.name], dict):
            continue
        if values[f.name] != d and not (isinstance(d, tuple) and list(d) == values[f.name]):
            differ[f.name] = (d, values[f.name])
    assert not differ, f"{cls.__name__} ({where}): dataclass default vs conf/: {differ}"
