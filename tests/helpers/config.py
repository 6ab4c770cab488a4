"""The project's config as Hydra composes it from conf/."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from .project import ROOT


def composed(*overrides: str) -> dict:
    from specdistill.core.config import register_resolvers

    register_resolvers()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)
