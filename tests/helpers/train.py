"""The train stage's config on the tiny target: the overrides that point it at temporary folders and the live
tiny target, and the config as the train front door composes it."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from .project import ROOT, front_door


def overrides(tmp_path, tiny_target_dir, generated, *extra):
    return [f"paths.generated_dir={generated}", f"paths.prompts_dir={tmp_path}/prompts",
            f"paths.models_dir={tmp_path}/models", f"paths.checkpoints_dir={tmp_path}/checkpoints",
            f"paths.metrics_dir={tmp_path}/metrics", f"paths.plots_dir={tmp_path}/plots",
            "target=hf", f"target.name_or_path={tiny_target_dir}", "target.dtype=float32", "target.device=cpu",
            "logger=none", "draft@methods.draft.draft=xs", "trainer.precision=32-true",
            "trainer.enable_progress_bar=false", "distill.data.batch_size=2", "distill.scheduler.num_warmup_steps=2",
            "methods.draft.vocab_size=128",
            "methods.eagle.teacher=live", "methods.eagle1.teacher=live", "methods.dflash.teacher=live",
            *extra]  # no features store: the live target


def composed(*ovr):
    """The config as the train front door composes it (`loss=fkl` is shorthand for the chosen method's)."""
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        return OmegaConf.to_container(compose("config", overrides=front_door("train").method_groups(list(ovr))),
                                      resolve=True)
