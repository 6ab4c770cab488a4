"""EAGLE draft heads (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"; EAGLE-3, Li et al. 2025): one decoder layer that drafts in the target's feature space.

The head at position t reads the target's state h_t and the embedding of the next token x_{t+1}
(the target's frozen embeddings) and predicts the next state, from which a vocabulary head gives
the distribution of x_{t+2}; fed its own output, it drafts further steps.

- ``eagle1``: h_t is the input of the target's final norm (`HiddenTap` index num_layers). It is taken
  per token to unit RMS (u = h / rms(h)): SmolLM2's pre-norm states have outlier dimensions and a
  first position of norm ~6,000, and the final RMSNorm is scale-invariant, so the target's own
  norm and LM head turn u into exactly the target's logits. fc(concat(embed, u)) -> a Llama decoder
  layer (no input norm, as in EAGLE-1) -> predicted u_{t+1}; logits through the target's frozen
  final norm and LM head (rows d2t with a reduced vocabulary).
- ``eagle3``: fuses three target layers (low, middle, high), raw, by fc [3H -> H]; the EAGLE-3
  "midlayer" attends over concat(input_layernorm(embed), hidden_norm(hidden)) (2H wide) with the
  fused hidden state as its residual; its own final norm and a trainable LM head over a reduced
  draft vocabulary (d2t). After the first step its own output (before the norm) replaces the fused
  target state: what training-time test unrolls.
- EAGLE-3.1 (May 2026) is two flags on eagle3, as speculators and vLLM name them: ``fc_norm`` (an RMSNorm per
  fused target layer before ``fc``, so a layer of large norm no longer dominates the fusion) and
  ``norm_output`` (the next step reads the normed output, the state the LM head reads, which keeps its
  magnitude from drifting across steps).

The KV cache of the head is the decoder's `PreallocatedCache` with one layer. Saved as
`eagle.safetensors` + `eagle_config.json` (`save_eagle`, via heads_io); `write_eagle3_layout` adds the EAGLE-3 layout
serving engines load.
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

CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "eagle.safetensors"
EXPORT_DIR = "eagle3"
VARIANTS = ("eagle1", "eagle3")


class EagleError(ValueError):
    """An EAGLE head that cannot serve this target, or a missing/invalid heads folder."""


@dataclass
class EagleConfig:
    variant: str = "eagle3"
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    rope_parameters: dict[str, Any] | None = None
    vocab_size: int = 49152  # the target's
    draft_vocab_size: int | None = None  # N with a reduced head (d2t)
    feature_layers: list[int] = field(default_factory=list)  # HiddenTap indices the head reads
    target_num_layers: int | None = None
    target_fingerprint: str | None = None
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm per fused layer before fc
    norm_output: bool = False  # EAGLE-3.1: the next step reads norm(output)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise EagleError(f"eagle variant={self.variant!r}: use one of {VARIANTS}")
        if self.variant == "eagle1" and (self.fc_norm or self.norm_output):
            raise EagleError("fc_norm and norm_output are EAGLE-3.1 flags: eagle3 heads only")
        want = 1 if self.variant == "eagle1" else 3
        if len(self.feature_layers) != want:
            raise EagleError(f"{self.variant} reads {want} target layer(s), got feature_layers={self.feature_layers}")

    def llama_config(self, hidden_size: int | None = None) -> Any:
        from transformers import LlamaConfig

        cfg = LlamaConfig(hidden_size=hidden_size or self.hidden_size, intermediate_size=self.intermediate_size,
                          num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                          head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, num_hidden_layers=1,
                          max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
                          rope_parameters=copy.deepcopy(self.rope_parameters))
        cfg._attn_implementation = "sdpa"
        return cfg


def unit_rms(h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """h / rms(h) per token: the scale-free part of a state, which the target's final RMSNorm sees."""
    h = h.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class Eagle1Layer(nn.Module):
    """fc(concat(embed, u)) -> a Llama decoder layer without its input norm (EAGLE-1)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layer = LlamaDecoderLayer(cfg.llama_config(), layer_idx=0)
        self.layer.input_layernorm = nn.Identity()

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, position_embeddings: Any, mask: torch.Tensor,
                cache: Any) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        return self.layer(x, attention_mask=mask, position_embeddings=position_embeddings, cache=cache)


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over concat(norm(embed), norm(hidden)) with `hidden` as the residual."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        h = cfg.hidden_size
        self.input_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg.llama_config(hidden_size=2 * h), layer_idx=0)  # q/k/v read 2H
        self.self_attn.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, h, bias=False)  # back to H
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.llama_config())

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, position_embeddings: Any, mask: torch.Tensor,
                cache: Any) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x, _ = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=mask, cache=cache)
        hidden = hidden + x
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig, embed: nn.Module, d2t: torch.Tensor | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        if (d2t is None) != (cfg.draft_vocab_size is None) or (d2t is not None and len(d2t) != cfg.draft_vocab_size):
            raise EagleError("a reduced EAGLE head needs its d2t map, of draft_vocab_size ids")
        self.cfg = cfg
        h = cfg.hidden_size
        self._embed = [embed]  # the target's embeddings, frozen and not ours: not a submodule, not saved
        self.fc_norm = None
        if cfg.variant == "eagle1":
            self.fc = None
            self.midlayer = Eagle1Layer(cfg)
        else:
            self.fc = nn.Linear(len(cfg.feature_layers) * h, h, bias=False)
            self.midlayer = Eagle3Layer(cfg)
            if cfg.fc_norm:  # one per fused layer, in feature_layers order
                self.fc_norm = nn.ModuleList(LlamaRMSNorm(h, eps=cfg.rms_norm_eps) for _ in cfg.feature_layers)
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())
        self.register_buffer("d2t", None if d2t is None else d2t.long().clone())
        if cfg.variant == "eagle1":  # the target's norm and LM head, frozen: the features must stay the target's
            self.norm.requires_grad_(False)
            self.lm_head.requires_grad_(False)

    @property
    def embed(self) -> nn.Module:
        return self._embed[0]

    def features_in(self, features: torch.Tensor) -> torch.Tensor:
        """The hidden input of the first step from the target's states [..., F] (F = H, or 3H for eagle3)."""
        if self.fc is None:
            return unit_rms(features).to(self.lm_head.weight.dtype)
        features = features.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(features)

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
             cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step on [B, T]: (the predicted state [B, T, H] that feeds the next step, logits [B, T, N])."""
        out = self.advance(hidden, tokens, position_ids, mask, cache)
        return out, self.logits(out)

    def advance(self, hidden: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                cache: Any) -> torch.Tensor:
        """The predicted states that feed the next step (training scores the few anchors that count, not every
        position): the layer's output, or with norm_output that output normed."""
        embeds = self.embed(tokens).to(hidden.dtype)
        out = self.midlayer(hidden, embeds, self.rotary(hidden, position_ids), mask, cache)
        return self.norm(out) if self.cfg.norm_output else out

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """The draft's logits from `advance`'s states (normed already with norm_output)."""
        return self.lm_head(states if self.cfg.norm_output else self.norm(states))


def build_eagle(target: Any, variant: str, feature_layers: list[int], d2t: torch.Tensor | None = None,
                fingerprint: str | None = None, seed: int = 0, fc_norm: bool = False,
                norm_output: bool = False) -> EagleHead:
    """A trainable head for an HF Llama-family `target` (float32); the decoder layer starts from the
    target's last layer where shapes allow (EAGLE-1) and its vocabulary head from the target's LM head."""
    t = target.config
    cfg = EagleConfig(variant=variant, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                      num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                      head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
                      rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
                      rope_parameters=copy.deepcopy(getattr(t, "rope_parameters", None)), vocab_size=t.vocab_size,
                      draft_vocab_size=None if d2t is None else len(d2t), feature_layers=list(feature_layers),
                      target_num_layers=t.num_hidden_layers, target_fingerprint=fingerprint, fc_norm=fc_norm,
                      norm_output=norm_output)
    torch.manual_seed(seed)
    head = EagleHead(cfg, target.get_input_embeddings(), d2t)
    lm = target.get_output_embeddings().weight.detach().float()
    with torch.no_grad():
        head.lm_head.weight.copy_(lm if d2t is None else lm[d2t])
        head.norm.weight.copy_(target.get_decoder().norm.weight.float())
        if variant == "eagle1":
            src = target.get_decoder().layers[-1]
            dst = head.midlayer.layer
            dst.self_attn.load_state_dict(src.self_attn.state_dict())
            dst.mlp.load_state_dict(src.mlp.state_dict())
            dst.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
    return head.float().train()


def save_eagle(head: EagleHead, out_dir: str | Path, extra: dict[str, Any] | None = None) -> None:
    with atomic_path(out_dir, is_dir=True) as tmp:
        write_heads(tmp, head, head.cfg, CONFIG_FILE, WEIGHTS_FILE, extra)
        if head.cfg.variant == "eagle3":  # beside ours, the layout EAGLE-3 serving engines load
            write_eagle3_layout(head, tmp / EXPORT_DIR)


def write_eagle3_layout(head: EagleHead, out: Path) -> None:
    """`config.json` + `model.safetensors` as vLLM/SGLang load an EAGLE-3 draft (docs/serving.md).

    Tensor names are ours already (fc, midlayer.*, norm, lm_head); the embeddings are the target's
    and not written; `d2t` becomes the OFFSET the engines read (target id = i + d2t[i]) and `t2d`
    a bool mask over the target vocabulary. The aux layers are named only when they differ from the
    engines' default [2, L//2, L-3] (hidden_states indices), since vLLM and SGLang count explicit ids differently.
    """
    from safetensors.torch import save_file

    cfg = head.cfg
    if cfg.variant != "eagle3":
        raise EagleError("only eagle3 heads have a serving-engine layout (EAGLE-3)")
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in head.state_dict().items() if k != "d2t"}
    n = cfg.draft_vocab_size or cfg.vocab_size
    d2t = head.d2t.cpu() if head.d2t is not None else torch.arange(n)
    state["d2t"] = (d2t - torch.arange(n)).to(torch.int64)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    state["t2d"] = t2d
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
              "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
              "vocab_size": cfg.vocab_size, "draft_vocab_size": n, "target_hidden_size": cfg.hidden_size,
              "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
              "bos_token_id": None, "eos_token_id": None}
    if cfg.fc_norm or cfg.norm_output:  # EAGLE-3.1, under speculators' names
        config.update(fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)
    rope = cfg.rope_parameters or {}
    if rope.get("rope_theta") is not None:
        config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    layers = cfg.target_num_layers or 0
    if cfg.feature_layers != [2, layers // 2, layers - 3]:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers)}  # vLLM's convention
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_eagle3_layout(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, tensors) of an exported EAGLE-3 folder; d2t back to target ids (for tests and checks)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    state["d2t"] = state["d2t"] + torch.arange(len(state["d2t"]))
    return config, state


def load_eagle(path: str | Path, target: Any, dtype: torch.dtype = torch.float32,
               target_fingerprint: str | None = None) -> EagleHead:
    """A head saved by `save_eagle`, or a speculators-format EAGLE-3 folder (our export, or any speculators
    trainer's), wired to `target`'s embeddings; refused for another target."""
    from specdistill.export.speculators import is_speculators_folder

    if is_speculators_folder(path):
        cfg, state = read_eagle3(path, target, target_fingerprint)
    else:
        cfg, state = read_heads(path, EagleConfig, CONFIG_FILE, WEIGHTS_FILE, EagleError, "EAGLE head", "train@eagle",
                                target_fingerprint)
    if cfg.vocab_size != target.get_input_embeddings().weight.shape[0]:
        raise EagleError(f"the EAGLE head at {path} drafts for a {cfg.vocab_size}-token vocabulary, the target has "
                         f"{target.get_input_embeddings().weight.shape[0]}: it must share the target's tokenizer")
    if cfg.hidden_size != target.config.hidden_size:
        raise EagleError(f"the EAGLE head at {path} reads a target of width {cfg.hidden_size}, this one has "
                         f"{target.config.hidden_size}: train a head for it (`dvc repro train@eagle`)")
    head = EagleHead(cfg, target.get_input_embeddings(), d2t=state.get("d2t"))
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise EagleError(f"EAGLE weights at {path} do not fit its config ({str(e).splitlines()[0]} ...): the folder "
                         "mixes two trainings; retrain (`dvc repro -f train@eagle`)") from None
    if [m for m in missing if "rotary" not in m] or unexpected:
        raise EagleError(f"EAGLE weights at {path} do not fit its config: missing {missing}, unexpected {unexpected}")
    # the head's own weights load on the CPU; it runs beside the target's embeddings, wherever they are
    return head.to(device=target.get_input_embeddings().weight.device, dtype=dtype).eval().requires_grad_(False)


# what a speculators EAGLE-3 config may set that our head computes as it does (else the head is another drafter)
SUPPORTED = {"norm_before_residual": False, "norm_before_fc": False}


def read_eagle3(path: str | Path, target: Any, target_fingerprint: str | None = None
                ) -> tuple[Any, dict[str, torch.Tensor]]:
    """(EagleConfig, our head's tensors) of a speculators-format EAGLE-3 folder, written by our export or by any
    speculators trainer, for `target`. The inverse of `eagle3_state`: `layers.0.*` -> `midlayer.*`, d2t offsets ->
    target ids, the aux layers in their ascending order (fc's blocks as stored). Refused with the reason: another
    model type, a verifier of another vocabulary, width or depth (or another exported target's fingerprint), or a flag
    our head does not compute (a head trained with it would be another drafter here). `target` is the HF model."""

    from specdistill.core.models.hidden import fused_layers
    from specdistill.export.speculators import check_verifier, layer_fields, read_state

    path = Path(path)
    c = json.loads((path / "config.json").read_text())
    if c.get("speculators_model_type") != "eagle3":
        raise EagleError(f"{path} is a speculators {c.get('speculators_model_type')!r} folder, not eagle3: point "
                         "decode.eagle.path at an EAGLE-3 checkpoint")
    if unsupported := {k: c[k] for k, v in SUPPORTED.items() if c.get(k, v) != v}:
        raise EagleError(f"{path} was trained with {unsupported}, which our EAGLE-3 head does not compute: its drafts "
                         "here would be another drafter's. Train with `--no-norm-before-residual --no-norm-before-fc` "
                         "(speculators) to measure it here; the engine serves it as it is")
    layer = c["transformer_layer_config"]
    t = target.config
    check_verifier(path, c, target, target_fingerprint, EagleError)
    if layer.get("num_hidden_layers", 1) != 1:
        raise EagleError(f"{path} has {layer['num_hidden_layers']} decoder layers; our EAGLE-3 head has one")
    ids = sorted(c.get("eagle_aux_hidden_state_layer_ids") or fused_layers(t.num_hidden_layers))
    if max(ids) > t.num_hidden_layers:
        raise EagleError(f"{path} reads target layers {ids}; this target has {t.num_hidden_layers}")
    state, draft_vocab = read_state(path, c, ("layers.0.", "midlayer."), EagleError)
    cfg = EagleConfig(variant="eagle3", **layer_fields(c, target, 1e-5), draft_vocab_size=draft_vocab,  # Llama's eps
                      feature_layers=ids,
                      target_num_layers=t.num_hidden_layers, fc_norm=bool(c.get("fc_norm")),
                      norm_output=bool(c.get("norm_output")))
    return cfg, state
