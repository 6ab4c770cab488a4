"""Medusa heads on the frozen target (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration
Framework with Multiple Decoding Heads").

Head k (k = 1..K) reads the target's last hidden state h_t (after the final norm: what the LM head
reads) and predicts the token k+1 steps ahead, x_{t+k+1}; the target's own LM head already predicts
x_{t+1}. A head is n residual blocks x + SiLU(W x + b) and a vocabulary projection initialised from
the target's LM head. W starts at zero, so every head starts as the LM head itself (Medusa's init):
it predicts the next token, a good first guess for the token after it.

With a reduced vocabulary (`d2t`, core/models/vocab.py) each projection scores N target tokens: on
SmolLM2 a full-vocabulary head is 49k x 576 = 28M parameters, so 4 of them would cost about a whole
target forward per decoding step on a CPU.

Saved as `medusa.safetensors` (+ `d2t`) and `medusa_config.json`, which names the target's
fingerprint, K and n; `tree.json` beside them holds the trees built from the measured accuracies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdistill.core.io import atomic_path
from specdistill.core.models.heads_io import load_state, read_heads, write_heads

CONFIG_FILE = "medusa_config.json"
WEIGHTS_FILE = "medusa.safetensors"
TREE_FILE = "tree.json"


class MedusaError(ValueError):
    """Medusa heads that cannot serve this target, or a missing/invalid heads folder."""


@dataclass
class MedusaConfig:
    num_heads: int = 4  # K
    num_layers: int = 1  # n residual blocks per head
    hidden_size: int = 576
    vocab_size: int = 49152  # the target's vocabulary
    draft_vocab_size: int | None = None  # N with a reduced head (d2t), else None
    target_fingerprint: str | None = None


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # the head starts as the LM head (Medusa's initialisation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig, lm_head_weight: torch.Tensor | None = None, d2t: torch.Tensor | None = None):
        super().__init__()
        if cfg.num_heads < 1 or cfg.num_layers < 0:
            raise MedusaError(f"medusa num_heads={cfg.num_heads} must be >= 1 and num_layers={cfg.num_layers} >= 0")
        if (d2t is None) != (cfg.draft_vocab_size is None) or (d2t is not None and len(d2t) != cfg.draft_vocab_size):
            raise MedusaError("a reduced Medusa head needs its d2t map, of draft_vocab_size ids")
        self.cfg = cfg
        out = cfg.draft_vocab_size or cfg.vocab_size
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)],
                          nn.Linear(cfg.hidden_size, out, bias=False))
            for _ in range(cfg.num_heads))
        self.register_buffer("d2t", None if d2t is None else d2t.long().clone())
        if lm_head_weight is not None:
            w = lm_head_weight if d2t is None else lm_head_weight[d2t]
            with torch.no_grad():
                for head in self.heads:
                    head[-1].weight.copy_(w)

    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads

    def head(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of head k (1-based: predicts k+1 tokens ahead) over its vocabulary, from h [..., H]."""
        return self.heads[k - 1](hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[K, ..., N]: every head's logits from the same hidden states [..., H]."""
        return torch.stack([h(hidden) for h in self.heads])


def build_medusa(target: Any, num_heads: int, num_layers: int, d2t: torch.Tensor | None = None,
                 fingerprint: str | None = None) -> MedusaHeads:
    """Trainable heads for an HF causal LM `target`, projections copied from its LM head (float32)."""
    lm_head = target.get_output_embeddings().weight.detach().float()
    cfg = MedusaConfig(num_heads, num_layers, lm_head.shape[1], lm_head.shape[0],
                       None if d2t is None else len(d2t), fingerprint)
    return MedusaHeads(cfg, lm_head, d2t).float().train()


def save_medusa(heads: MedusaHeads, out_dir: str | Path, extra: dict[str, Any] | None = None,
                trees: dict[str, Any] | None = None) -> None:
    """The heads folder, written atomically: config, weights (+ d2t), trees, training settings."""
    with atomic_path(out_dir, is_dir=True) as tmp:
        write_heads(tmp, heads, heads.cfg, CONFIG_FILE, WEIGHTS_FILE, extra)
        if trees is not None:
            (tmp / TREE_FILE).write_text(json.dumps(trees, indent=2, sort_keys=True) + "\n")


def load_medusa(path: str | Path, dtype: torch.dtype = torch.float32, target_fingerprint: str | None = None,
                target: nn.Module | None = None) -> MedusaHeads:
    """Heads saved by `save_medusa`; refused when they were trained on another target (by its fingerprint,
    and by `target`'s width and vocabulary when given)."""
    cfg, state = read_heads(path, MedusaConfig, CONFIG_FILE, WEIGHTS_FILE, MedusaError, "Medusa heads",
                            "train@medusa", target_fingerprint, target)
    heads = MedusaHeads(cfg, d2t=state.get("d2t"))
    load_state(heads, state, path, "Medusa heads", "train@medusa", MedusaError)
    return heads.to(dtype).eval().requires_grad_(False)


def load_trees(path: str | Path) -> dict[str, Any]:
    f = Path(path) / TREE_FILE
    if not f.exists():
        raise MedusaError(f"{f} is missing: train@medusa writes the trees beside the heads; "
                          "or give decode.medusa.choices")
    return json.loads(f.read_text())
