"""The frozen target: one loader for a hub id, a local HF folder or a GGUF file.

`Target.forward` returns logits and, on request, hidden states (indices as in `core/models/hidden.py`:
0 the embeddings, i the output of decoder layer i, so `num_layers` is the final norm's input, and
`"final"` the normed state).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdistill.core import hardware
from specdistill.core.io import sha256_cached_all
from specdistill.core.models import dequantised
from specdistill.core.models.hidden import HiddenLayerError, HiddenTap

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetError(RuntimeError):
    """The target cannot be loaded as configured."""


def auto_dtype(device: str) -> str:
    """`target.dtype=auto`: bfloat16 where the device computes it (`hardware.computes_bf16`), else float16 on a GPU
    and float32 on a CPU. On an AVX2 CPU bf16 is emulated: generate made 3 tokens/s at batch 8 there, and verifying
    8 draft nodes cost 4.25 plain steps in bf16 against 1.81 in float32 (docs/findings.md)."""
    if hardware.computes_bf16(device):
        return "bfloat16"
    return "float16" if str(device).startswith("cuda") else "float32"


def warn_if_emulated_bf16(cfg: TargetConfig) -> None:
    if cfg.dtype == "bfloat16" and str(cfg.device).startswith("cpu") and not hardware.computes_bf16("cpu"):
        log.warning("target.dtype=bfloat16 on a CPU without native bfloat16 (%s): multi-token forwards (batched "
                    "generation, prefill, verifying a draft tree) run several times slower than in float32 (a "
                    "2-core AVX2 EPYC: 8-node verification 206 ms against 142, 4.6 plain steps against 1.9). "
                    "Results stay correct; for speed pass target.dtype=auto or float32 (new generated data and "
                    "every later stage) and check with benchmarks/verify_cost.py.",
                    torch.backends.cpu.get_cpu_capability())


@dataclass
class TargetConfig:
    name_or_path: str
    gguf_file: str | None = None
    revision: str | None = None
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (resolved here, for this machine: auto_dtype)
    device: str = "cpu"
    trust_remote_code: bool = False
    attn_implementation: str | None = "sdpa"
    num_threads: int | None = None
    # target=hf: what the local folder held when params.yaml was composed (config.files_stamp), so DVC reruns the
    # stages that read the target when its weights change at the same path; read by DVC only
    stamp: str | None = None

    def __post_init__(self) -> None:
        # every stage reads the resolved name: what the data's fingerprint, the records and the engine's job say
        # (load_target's log line names it)
        if self.dtype == "auto":
            self.dtype = auto_dtype(self.device)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetConfig:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise TargetError(f"unknown target config keys {sorted(unknown)}; "
                              f"known: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)


@dataclass
class TargetOutput:
    logits: torch.Tensor
    hidden: dict[int | str, torch.Tensor] = field(default_factory=dict)
    cache: Any = None


def _fingerprint(cfg: TargetConfig, config: Any) -> str:
    """What names the target's weights: the GGUF's or the folder's sha256, or the hub commit (from its HF config)."""
    path = Path(cfg.name_or_path)
    if cfg.gguf_file:
        return "sha256:" + dequantised.gguf_sha256(path / cfg.gguf_file)
    if path.is_dir():
        weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        import hashlib

        h = hashlib.sha256()
        # each file read once, then kept under its stat (hashing ran at ~1.4 GB/s here: 4 GB in 2.8 s, every stage)
        for w, digest in zip(weights, sha256_cached_all(weights), strict=True):
            h.update(w.name.encode())
            h.update(digest.encode())
        return "sha256:" + h.hexdigest()
    commit = getattr(config, "_commit_hash", None) or cfg.revision or "unknown"
    return f"hub:{cfg.name_or_path}@{commit}"


class Target:
    """A frozen causal LM with its tokenizer and a fingerprint of the weights it was loaded from."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, fingerprint: str = "unknown"):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.config = model.config
        self.num_layers: int = model.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def stop_ids(self) -> set[int]:
        return stop_ids(self.model, self.tokenizer)

    @property
    def pad_id(self) -> int:
        """What pads a batch: the tokenizer's pad token, else 0 (padded positions are masked, never read)."""
        return self.tokenizer.pad_token_id or 0

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                hidden_layers: list[int | str] | str | None = None, cache: Any = None,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0) -> TargetOutput:
        """Logits (float32) and the requested hidden states: a list of indices, "all", or None."""
        layers = list(range(self.num_layers + 1)) + ["final"] if hidden_layers == "all" else hidden_layers or []
        try:
            tap = HiddenTap(self.model, layers)
        except HiddenLayerError as e:
            raise TargetError(str(e)) from e
        with tap:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, use_cache=cache is not None, logits_to_keep=logits_to_keep)
        return TargetOutput(logits=out.logits.float(), hidden=tap.states, cache=getattr(out, "cache", None))


def stop_ids(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end a generation: the eos of the model's generation_config and of its tokenizer (either may be
    None: the engine's side has only the tokenizer)."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, list | tuple) else [eos])
    if not ids:
        raise TargetError("the target has no eos token: set one on its tokenizer or generation_config")
    return ids


def _dequantised(cfg: TargetConfig) -> Path | None:
    """A GGUF target's cached dequantised folder (core/models/dequantised.py), when one is there."""
    gguf = Path(cfg.name_or_path) / cfg.gguf_file if cfg.gguf_file else None
    return dequantised.cached(gguf, cfg.dtype) if gguf is not None and gguf.exists() else None


def load_tokenizer(cfg: TargetConfig) -> Any:
    from transformers import AutoTokenizer

    if (folder := _dequantised(cfg)) is not None:
        return AutoTokenizer.from_pretrained(folder)
    kw: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code, "revision": cfg.revision}
    if cfg.gguf_file:
        kw["gguf_file"] = cfg.gguf_file
    return AutoTokenizer.from_pretrained(cfg.name_or_path, **kw)


def context_length(config: Any) -> int | None:
    """The positions the target was trained for (`max_position_embeddings`), or None when it does not say."""
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(n) if n else None


def load_target_config(cfg: TargetConfig) -> Any:
    """The target's HF config alone (for its context length and widths), without loading its weights."""
    from transformers import AutoConfig

    if (folder := _dequantised(cfg)) is not None:
        return AutoConfig.from_pretrained(folder)
    kw: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code, "revision": cfg.revision}
    if cfg.gguf_file:
        kw["gguf_file"] = cfg.gguf_file
    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, **kw)
    except OSError as e:
        raise TargetError(f"cannot read the config of target '{cfg.name_or_path}': {e}. Run the fetch_assets "
                          "stage first, or point target.name_or_path at a local model folder") from e


def target_fingerprint(cfg: TargetConfig) -> str:
    """The target's fingerprint without loading its weights (the engine loads them in its own process)."""
    return _fingerprint(cfg, None if cfg.gguf_file or Path(cfg.name_or_path).is_dir() else load_target_config(cfg))


def load_target(cfg: TargetConfig | dict[str, Any]) -> Target:
    """Load and freeze the target described by `cfg` (see conf/target/)."""
    from transformers import AutoModelForCausalLM

    if isinstance(cfg, dict):
        cfg = TargetConfig.from_dict(cfg)
    if cfg.dtype not in DTYPES:
        raise TargetError(f"target.dtype={cfg.dtype!r} is not one of {sorted(DTYPES)} or auto")
    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    warn_if_emulated_bf16(cfg)
    if cfg.gguf_file:
        gguf = Path(cfg.name_or_path) / cfg.gguf_file
        if not gguf.exists():
            raise TargetError(f"GGUF file {gguf} does not exist: run the fetch_assets stage first "
                              "(`dvc repro fetch_assets`) or point target.name_or_path at its folder")
    kw: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code, "revision": cfg.revision,
                          "dtype": DTYPES[cfg.dtype]}
    source = cfg.name_or_path
    if (folder := _dequantised(cfg)) is not None:  # the GGUF as an earlier process dequantised it
        source, kw = str(folder), {"dtype": DTYPES[cfg.dtype]}
    elif cfg.gguf_file:
        kw["gguf_file"] = cfg.gguf_file
    if cfg.attn_implementation:
        kw["attn_implementation"] = cfg.attn_implementation
    # transformers 5 dequantizes this GGUF architecture in full (no packed kernel for it), yet warns
    # that packed weights compute in float32; the warning does not apply, so it is silenced.
    logging.getLogger("transformers.quantizers.quantizer_gguf").setLevel(logging.ERROR)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kw)
    except OSError as e:
        raise TargetError(f"cannot load target '{cfg.name_or_path}': {e}. Without hub access, point "
                          "target.name_or_path at a local folder or use the default GGUF target") from e
    model.to(cfg.device)
    tokenizer = load_tokenizer(cfg)
    target = Target(model, tokenizer, _fingerprint(cfg, model.config))
    if cfg.gguf_file and folder is None:
        dequantised.write(model, tokenizer, Path(cfg.name_or_path) / cfg.gguf_file, cfg.dtype, target.fingerprint)
    log.info("target %s loaded (%s, %d layers, vocab %d, %s)", cfg.name_or_path, cfg.dtype,
             target.num_layers, target.vocab_size, target.fingerprint[:20])
    return target
