"""export@<method>: engine-ready folders (DVC outputs) that vLLM and SGLang load as they are.

`export_target` writes the target as an HF safetensors folder (a GGUF target dequantised: the engine cannot
serve the GGUF file) and `export@eagle` the trained EAGLE-3 head in the speculators format naming that folder as
its verifier, so that `vllm serve models/export/eagle` (from the project root) serves target + draft with no flags.
A draft that does not fit the exported target (another vocabulary, width, depth or fingerprint) is refused here,
before any engine sees it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from specdistill import methods
from specdistill.core.config import section
from specdistill.core.models.target import TargetConfig, load_target
from specdistill.core.stage import ConfigError, check_outputs
from specdistill.core.tracking import log_folder, wandb_run
from specdistill.export.target import ExportError, export_target

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ExportConfig:
    method: str
    dir: str
    dtype: str | None
    # export@<key> (dvc.yaml makes one per key): `method`, the registered method that exports it; `model`, the
    # trained folder it reads (conf/export/default.yaml)
    items: dict[str, dict[str, str]]
    num_speculative_tokens: int
    RANGES: ClassVar[dict[str, str]] = {"num_speculative_tokens": "[1, 16]"}  # checked by `section`

    @property
    def registered(self) -> str:
        """The registered method that exports this item."""
        return self.items[self.method]["method"]

    @property
    def models(self) -> dict[str, str]:
        """method -> the trained folder it exports (what a method's export finds by `trained_folder`): this item's."""
        return {} if self.method == "target" else {self.registered: self.items[self.method]["model"]}

    def __post_init__(self) -> None:
        for key, item in self.items.items():
            if set(item) != {"method", "model"}:
                raise ConfigError(f"export.items.{key}={item!r}: a map with keys method and model")
        if self.method != "target":  # the target itself, or an item's engine-ready export
            if self.method not in self.items:
                raise ConfigError(f"export.method={self.method!r}: use target or one of {sorted(self.items)} "
                                  f"(export.items)")
            methods.get(self.registered, "export", f"export.items.{self.method}.method")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"export.dtype={self.dtype!r}: use one of {sorted(DTYPES)} or null (the target's)")


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    export_cfg = section(ExportConfig, dict(cfg["export"]), "export")
    target_cfg = section(TargetConfig, dict(cfg["target"]), "target")
    out = Path(export_cfg.dir) / export_cfg.method
    check_outputs(cfg, replaced={"export.dir": out})
    target_dir = Path(export_cfg.dir) / "target"
    if export_cfg.method != "target" and not (target_dir / "config.json").exists():
        raise ExportError(f"export@{export_cfg.method} is checked against the exported target, and {target_dir} is "
                          f"missing: run `dvc repro export_target` first")
    with wandb_run(cfg.get("logger"), job_type="export", name=f"export@{export_cfg.method}",
                   group=cfg.get("experiment_name", "default"), config=cfg) as run_:
        if export_cfg.method == "target":
            target = load_target(target_cfg)
            export_target(target.model, target.tokenizer, out, target.fingerprint,
                          dtype=DTYPES[export_cfg.dtype or target_cfg.dtype])
            log.info("wrote %s (serve it: `vllm serve %s`, or with a draft: export@<method>)", out, out)
        else:  # the method loads the target only if its export needs it
            method = methods.get(export_cfg.registered, "export", f"export.items.{export_cfg.method}.method")
            method.export(export_cfg, out, target_dir, lambda: load_target(target_cfg))
            log.info("wrote %s (serve@%s serves it beside the target, where the engine runs its method)", out,
                     export_cfg.method)
        log_folder(run_, out, f"export@{export_cfg.method}")
    return {"export": str(out)}
