"""export@<method>: engine-ready folders (DVC outputs) that vLLM and SGLang load as they are.

`export@target` writes the target as an HF safetensors folder (a GGUF target dequantised: the engine cannot
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

from specdistill.export.draft import export_draft
from specdistill.export.eagle3 import export_eagle3
from specdistill.export.target import ExportError, export_target
from specdistill.models.target import TargetConfig, load_target
from specdistill.stages.common import ConfigError, check_outputs, section

log = logging.getLogger(__name__)

METHODS = ("target", "eagle", "draft")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ExportConfig:
    method: str
    dir: str
    dtype: str | None
    eagle_path: str
    draft_path: str
    num_speculative_tokens: int
    RANGES: ClassVar[dict[str, str]] = {"num_speculative_tokens": "[1, 16]"}  # checked by `section`

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"export.method={self.method!r}: use one of {METHODS}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"export.dtype={self.dtype!r}: use one of {sorted(DTYPES)} or null (the target's)")


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    ecfg = section(ExportConfig, dict(cfg["export"]), "export")
    tcfg = section(TargetConfig, dict(cfg["target"]), "target")
    out = Path(ecfg.dir) / ecfg.method
    check_outputs(cfg, replaced={"export.dir": out})
    target_dir = Path(ecfg.dir) / "target"
    if ecfg.method != "target" and not (target_dir / "config.json").exists():
        raise ExportError(f"export@{ecfg.method} is checked against the exported target, and {target_dir} is missing: "
                          f"run `dvc repro export@target` first")
    if ecfg.method == "draft":  # a plain HF folder: the target itself need not load
        export_draft(ecfg.draft_path, out, target_dir)
        log.info("wrote %s (vLLM: speculative_config method=draft_model; HF: assistant_model)", out)
        return {"export": str(out)}
    target = load_target(tcfg)
    if ecfg.method == "target":
        dtype = DTYPES[ecfg.dtype or tcfg.dtype]
        export_target(target.model, target.tokenizer, out, target.fingerprint, dtype=dtype)
    else:
        from specdistill.models.eagle import load_eagle

        head = load_eagle(ecfg.eagle_path, target.model, dtype=torch.float32, target_fingerprint=target.fingerprint)
        export_eagle3(head, out, target_dir, num_speculative_tokens=ecfg.num_speculative_tokens)
    log.info("wrote %s (serve it: `vllm serve %s`%s)", out, out,
             "" if ecfg.method == "eagle" else ", or with a draft: export@eagle")
    return {"export": str(out)}
