"""DFlash, a parallel block drafter (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding",
arXiv 2602.06036): a few transformer layers at the target's width draft a whole block in ONE forward.

The block at anchor p is [x_p, M, ..., M] at positions p..p+K (x_p: the last token, whose target state is not
known yet; M: a learned mask embedding). Its queries attend, without a causal mask, to each other and to the
target's context: the target's fused features at positions 0..p-1, taken through `fc` and `hidden_norm` and
projected by each layer's own k/v projections (the "injected" keys and values, RoPE at their positions). The
output at mask slot j (position p+j) is the draft's distribution of x_{p+j} itself. So K tokens cost one
forward of `num_layers` layers over K+1 queries, where EAGLE-3 runs its layer K times in sequence.

A slot cannot see the tokens drawn at the slots before it, so its guesses decay along the block. DSpark (Cheng et
al. 2026, arXiv 2607.05147) adds a sequential head to the parallel block: slot j's logits get a low-rank bias from
the token before it, W2 W1[x_{p+j-1}] (`markov_rank` r > 0; its "Markov head"). Drafting then runs the block once
and the head K times, a lookup and an r x N product each; training reads the token that preceded each slot.
XPress (arXiv 2608.02438) replaces that head with a causal refiner (`refiner_rank` r > 0, methods/dflash/xpress.py):
the bias of slot j also reads the slot's state and the block's, and every token drawn before it in the block.

Layer by layer it is vLLM's `DFlashQwen3Model` (qwen3_dflash.py), so the export is a rename: a Qwen3-style
layer (RMSNorm per head on q and k), pre-norm residuals, a final norm, and an LM head over a reduced draft
vocabulary (`d2t`). The bonus token reads the target's own (frozen) embeddings, which the engine shares too.
Saved as `dflash.safetensors` + `dflash_config.json` (core/models/heads_io.py).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdistill.core.io import atomic_path
from specdistill.core.models.heads_io import read_heads, write_heads

CONFIG_FILE = "dflash_config.json"
WEIGHTS_FILE = "dflash.safetensors"
MASK_FILE = "mask_embedding.pt"  # the speculators format's learned mask embedding (the engine swaps it in)
MASK = -1  # a block slot that holds the mask embedding (ids are >= 0 otherwise)
INIT_LAYERS = ("last", "first", "random")  # which of the target's layers the drafter's start from


class DFlashError(ValueError):
    """A block drafter that cannot serve this target, or a missing/invalid folder."""


@dataclass
class DFlashConfig:
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    rope_parameters: dict[str, Any] | None = None
    num_layers: int = 2
    block_size: int = 8  # slots per block: the anchor's token and block_size - 1 masks (K = block_size - 1)
    vocab_size: int = 49152  # the target's
    draft_vocab_size: int | None = None  # N with a reduced head (d2t)
    feature_layers: list[int] = field(default_factory=list)  # HiddenTap indices = vLLM's aux ids (residual into k)
    mask_token_id: int = 0  # the id the engine substitutes the mask embedding for (mask_embedding.pt)
    markov_rank: int = 0  # DSpark's Markov head: the rank of the bias from the previous token (0: none, DFlash)
    refiner_rank: int = 0  # XPress's causal refiner: its rank (0: none)
    refiner_mlp_ratio: int = 2  # the refiner's MLP width over its rank
    target_num_layers: int | None = None
    target_fingerprint: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.num_layers <= 16:
            raise DFlashError(f"a DFlash drafter of {self.num_layers} layers: use 1..16")
        if self.block_size < 2:
            raise DFlashError(f"block_size={self.block_size}: a block holds the last token and at least one mask")
        if not self.feature_layers:
            raise DFlashError("a DFlash drafter reads at least one target layer (feature_layers)")
        if self.markov_rank < 0:
            raise DFlashError(f"markov_rank={self.markov_rank}: 0 (no Markov head) or the rank of its bias")
        if self.refiner_rank < 0 or self.refiner_mlp_ratio < 1:
            raise DFlashError(f"refiner_rank={self.refiner_rank}, refiner_mlp_ratio={self.refiner_mlp_ratio}: a rank "
                              ">= 0 (0: no refiner) and a ratio >= 1")
        if self.markov_rank and self.refiner_rank:
            raise DFlashError("a drafter has a Markov head (DSpark) or a causal refiner (XPress), not both: set "
                              "markov_rank or refiner_rank to 0")

    def rope_config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=copy.deepcopy(self.rope_parameters))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, neox layout (halves), on [B, heads, n, d] with cos / sin [B, n, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(h, nh * d, bias=False)
        self.k_proj = nn.Linear(h, nkv * d, bias=False)
        self.v_proj = nn.Linear(h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)
        self.q_norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [B, nkv, n, d] of normed states x [B, n, H] at the positions of cos / sin."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.nkv, self.d).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:
        """Block queries x [B, n, H] over the context's keys and their own (mask [B, 1, n, m + n] bool, or None)."""
        b, n, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).view(b, n, self.nh, self.d)).transpose(1, 2), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                                               enable_gqa=self.nh != self.nkv)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.nh * self.d))


class DFlashMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): Llama's and Qwen3's MLP, under their names."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the injected context keys / values."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, embed: nn.Module, d2t: torch.Tensor | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        if (d2t is None) != (cfg.draft_vocab_size is None) or (d2t is not None and len(d2t) != cfg.draft_vocab_size):
            raise DFlashError("a reduced DFlash head needs its d2t map, of draft_vocab_size ids")
        h = cfg.hidden_size
        self.cfg = cfg
        self._embed = [embed]  # the target's embeddings, frozen and not ours: not a submodule, not saved
        self.fc = nn.Linear(len(cfg.feature_layers) * h, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        if cfg.markov_rank:  # W1 over the target's ids (any token can precede a slot), W2 onto the draft vocabulary
            self.markov_in = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
            self.markov_out = nn.Linear(cfg.markov_rank, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
        if cfg.refiner_rank:
            from specdistill.methods.dflash.xpress import XPressRefiner

            self.refiner = XPressRefiner(cfg.vocab_size, cfg.draft_vocab_size or cfg.vocab_size, h, cfg.block_size,
                                         cfg.refiner_rank, cfg.refiner_mlp_ratio)
        self.rotary = LlamaRotaryEmbedding(cfg.rope_config())
        self.register_buffer("d2t", None if d2t is None else d2t.long().clone())

    @property
    def embed(self) -> nn.Module:
        return self._embed[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(like, positions)

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's injected (k, v) [B, nkv, T, d] from the target's fused features [B, T, F] at `positions`."""
        x = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = self._rope(x, positions)
        return [layer.self_attn.keys_values(x, cos, sin) for layer in self.layers]

    def embed_block(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot embeddings [B, n, H]: the target's for token ids, the learned mask embedding for MASK slots."""
        emb = self.embed(ids.clamp(min=0)).to(self.dtype)
        return torch.where((ids == MASK)[..., None], self.mask_embedding.to(self.dtype), emb)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]],
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Normed states [B, n, H] of block slots `ids` [B, n] at `positions`; `mask` [B, 1, n, T + n] (True: may
        attend) says which context and slot keys each query sees (None: all, one block while drafting)."""
        x = self.embed_block(ids)
        cos, sin = self._rope(x, positions)
        for layer, ctx in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, ctx, mask)
        return self.norm(x)

    def logits(self, states: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the draft vocabulary (d2t maps them to target ids) of slot states [..., H]; with a Markov head,
        `prev` [...] holds the target id before each slot (None: the block's own logits, without the head's bias)."""
        out = self.lm_head(states)
        return out if prev is None or not self.cfg.markov_rank else out + self.markov_bias(prev)

    def block_logits(self, states: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Logits [N, S, V'] of N whole blocks' slot states [N, S, H], with the head that reads the tokens before the
        slots (`prev` [N, S], the target id before each slot): XPress's refiner, DSpark's Markov head, or none."""
        out = self.lm_head(states)
        if self.cfg.refiner_rank:
            return out + self.refiner(prev, states)
        return out + self.markov_bias(prev) if self.cfg.markov_rank else out

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """DSpark's bias [..., N] on a slot's logits from the target id before it, `prev` [...]."""
        return self.markov_out(self.markov_in(prev))


def build_dflash(target: Any, feature_layers: list[int], num_layers: int, block_size: int, mask_token_id: int,
                 d2t: torch.Tensor | None = None, fingerprint: str | None = None, seed: int = 0,
                 markov_rank: int = 0, init_layers: str = "last", refiner_rank: int = 0,
                 refiner_mlp_ratio: int = 2) -> DFlashDrafter:
    """A trainable drafter at the target's width (float32): its layers start from the target's last `num_layers`
    layers (`init_layers`: "first", its first ones, whose inputs are embeddings as the block's are; "random": none),
    q/k norms at one, its head from the target's LM head rows, the mask from the mean embedding; a Markov head's W2
    from zero, so it starts as the plain block drafter."""
    if init_layers not in INIT_LAYERS:
        raise DFlashError(f"init_layers={init_layers!r}: use one of {INIT_LAYERS}")
    t = target.config
    cfg = DFlashConfig(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                       num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                       head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
                       rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
                       rope_parameters=copy.deepcopy(getattr(t, "rope_parameters", None)), num_layers=num_layers,
                       block_size=block_size, vocab_size=t.vocab_size,
                       draft_vocab_size=None if d2t is None else len(d2t),
                       feature_layers=list(feature_layers), mask_token_id=mask_token_id,
                       target_num_layers=t.num_hidden_layers, target_fingerprint=fingerprint, markov_rank=markov_rank,
                       refiner_rank=refiner_rank, refiner_mlp_ratio=refiner_mlp_ratio)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg, target.get_input_embeddings(), d2t)
    layers = target.get_decoder().layers
    src_layers = {"last": layers[-num_layers:], "first": layers[:num_layers], "random": []}[init_layers]
    lm = target.get_output_embeddings().weight.detach().float()
    with torch.no_grad():
        for src, dst in zip(src_layers, drafter.layers[:len(src_layers)], strict=True):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(dst.self_attn, name).load_state_dict(getattr(src.self_attn, name).state_dict())
            dst.mlp.load_state_dict(src.mlp.state_dict())
            dst.input_layernorm.load_state_dict(src.input_layernorm.state_dict())
            dst.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
        drafter.lm_head.weight.copy_(lm if d2t is None else lm[d2t])
        drafter.norm.weight.copy_(target.get_decoder().norm.weight.float())
        drafter.mask_embedding.copy_(target.get_input_embeddings().weight.detach().float().mean(0))
        if markov_rank:
            drafter.markov_out.weight.zero_()
    return drafter.float().train()


def save_dflash(drafter: DFlashDrafter, out_dir: str | Path, extra: dict[str, Any] | None = None) -> None:
    with atomic_path(out_dir, is_dir=True) as tmp:
        write_heads(tmp, drafter, drafter.cfg, CONFIG_FILE, WEIGHTS_FILE, extra)


def load_dflash(path: str | Path, target: Any, dtype: torch.dtype = torch.float32,
                target_fingerprint: str | None = None) -> DFlashDrafter:
    """A drafter saved by `save_dflash`, or a speculators-format DFlash / XPress folder (our export, or any speculators
    trainer's), wired to `target`'s embeddings; refused for another target."""
    from specdistill.export.speculators import is_speculators_folder

    if is_speculators_folder(path):
        cfg, state = read_dflash(path, target, target_fingerprint)
    else:
        cfg, state = read_heads(path, DFlashConfig, CONFIG_FILE, WEIGHTS_FILE, DFlashError, "DFlash drafter",
                                "train@dflash", target_fingerprint)
    emb = target.get_input_embeddings().weight
    if cfg.vocab_size != emb.shape[0] or cfg.hidden_size != emb.shape[1]:
        raise DFlashError(f"the DFlash drafter at {path} is for a target of vocabulary {cfg.vocab_size} and width "
                          f"{cfg.hidden_size}; this one has {tuple(emb.shape)}: "
                          "train one for it (`dvc repro train@dflash`)")
    drafter = DFlashDrafter(cfg, target.get_input_embeddings(), d2t=state.get("d2t"))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if [m for m in missing if "rotary" not in m] or unexpected:
        raise DFlashError(f"DFlash weights at {path} do not fit its config: missing {missing}, unexpected {unexpected}")
    return drafter.to(device=emb.device, dtype=dtype).eval().requires_grad_(False)


def read_dflash(path: str | Path, target: Any, target_fingerprint: str | None = None
                ) -> tuple[Any, dict[str, torch.Tensor]]:
    """(DFlashConfig, our drafter's tensors) of a speculators-format DFlash or XPress folder, ours or any speculators
    trainer's, for `target` (the HF model): the inverse of `dflash_state`. The mask embedding is `mask_embedding.pt`
    where the folder has one, else the target's embedding of `mask_token_id` (what the engine uses then). Refused
    with the reason: another model type, another verifier, a causal block or the DeepSeek slot layout
    (`sample_from_anchor`), which our drafter does not compute."""

    from specdistill.core.models.hidden import fused_layers
    from specdistill.export.speculators import check_verifier, layer_fields, read_state

    path = Path(path)
    c = json.loads((path / "config.json").read_text())
    kind = c.get("speculators_model_type")
    if kind not in ("dflash", "xpress"):
        raise DFlashError(f"{path} is a speculators {kind!r} folder; our block drafter reads dflash and xpress "
                          "checkpoints (point decode.dflash.path at one)")
    if not c.get("sliding_window_non_causal", True) or c.get("sample_from_anchor", False):
        raise DFlashError(f"{path} has sliding_window_non_causal={c.get('sliding_window_non_causal')}, "
                          f"sample_from_anchor={c.get('sample_from_anchor')}: our drafter computes the non-causal "
                          "block with the anchor in slot 0 (true, false); another layout would be another drafter here")
    check_verifier(path, c, target, target_fingerprint, DFlashError)
    layer, t = c["transformer_layer_config"], target.config
    ids = sorted(c.get("aux_hidden_state_layer_ids") or fused_layers(t.num_hidden_layers))
    state, draft_vocab = read_state(path, c, ("refiner_head.", "refiner."), DFlashError)
    mask_id = int(c.get("mask_token_id", 0))
    mask_file = path / MASK_FILE
    state["mask_embedding"] = (torch.load(mask_file, weights_only=True)["embedding"] if mask_file.exists()
                               else target.get_input_embeddings().weight[mask_id].detach().float().cpu())
    cfg = DFlashConfig(**layer_fields(c, target, 1e-6), num_layers=layer["num_hidden_layers"],  # Qwen3's epsilon
                       block_size=int(c["block_size"]), draft_vocab_size=draft_vocab, feature_layers=ids,
                       mask_token_id=mask_id, target_num_layers=t.num_hidden_layers,
                       refiner_rank=int(c.get("xpress_rank", 0)) if kind == "xpress" else 0,
                       refiner_mlp_ratio=int(c.get("xpress_mlp_ratio", 2)))
    return cfg, state
