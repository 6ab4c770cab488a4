"""A separate draft LM that shares the target's tokenizer.

`build_draft` makes a Llama-architecture causal LM sized by `conf/draft/` and initialised `random`
or `from_target` (the target's embeddings, final norm and LM head, and its first decoder layers;
widths must match). With the target's vocabulary it is a plain HF folder (`transformers` takes it
as `assistant_model`, vLLM as a draft model). With a reduced draft vocabulary (`vocab_size: N`) the
input embeddings still cover every target token (contexts hold any token) but the LM head predicts
only N tokens, the most frequent in the generated data; `d2t` (draft id -> target id) is saved in
`d2t.safetensors` beside the weights and `load_draft` restores it. That head is most of a small
draft's cost (49k x 576 on SmolLM2: 28M parameters against 3.5M per decoder layer), and the decoder
stays lossless: q is zero outside the draft vocabulary, which the acceptance rule accounts for.

`draft_from_target` (the target's first N layers, untrained) is the reference point of the decoder
benchmarks before distillation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from specdistill.core.io import atomic_path
from specdistill.core.models.heads_io import write_settings

D2T_FILE = "d2t.safetensors"


class DraftError(ValueError):
    """The draft cannot serve this target, or is configured wrongly."""


@dataclass
class DraftSize:
    """conf/draft/: the architecture of the draft; null widths take the target's."""

    name: str = "s"
    num_layers: int = 2
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    RANGES: ClassVar[dict[str, str]] = {"num_layers": "[1, inf)", "hidden_size": "[1, inf)",
                                        "num_attention_heads": "[1, inf)", "num_key_value_heads": "[1, inf)",
                                        "intermediate_size": "[1, inf)"}  # checked by `section`


INITS = ("random", "from_target")


def _draft_config(target_config: Any, size: DraftSize, vocab_size: int | None) -> Any:
    from transformers import LlamaConfig

    t = target_config
    cfg = LlamaConfig(
        vocab_size=t.vocab_size,
        hidden_size=size.hidden_size or t.hidden_size,
        intermediate_size=size.intermediate_size or t.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_attention_heads or t.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads or t.num_key_value_heads,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps,
        rope_parameters=getattr(t, "rope_parameters", None),
        # a reduced head cannot share the full input embedding matrix
        tie_word_embeddings=bool(getattr(t, "tie_word_embeddings", False)) and not vocab_size,
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, pad_token_id=getattr(t, "pad_token_id", None),
    )
    if vocab_size:
        cfg.draft_vocab_size = int(vocab_size)  # extra key: read back by load_draft
    return cfg


def _reduce_head(model: Any, d2t: torch.Tensor) -> None:
    old = model.get_output_embeddings()
    head = torch.nn.Linear(old.in_features, len(d2t), bias=False, dtype=old.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(old.weight[d2t])
    model.lm_head = head


def build_draft(target: Any, size: DraftSize, init: str = "from_target", d2t: torch.Tensor | None = None,
                seed: int = 0) -> Any:
    """A trainable Llama draft for `target` (an HF causal LM); with `d2t`, a head over those target ids."""
    from transformers import LlamaForCausalLM

    if init not in INITS:
        raise DraftError(f"draft init={init!r}: use one of {INITS}")
    if size.num_layers < 1:
        raise DraftError(f"draft num_layers={size.num_layers} must be >= 1")
    cfg = _draft_config(target.config, size, None if d2t is None else len(d2t))
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(cfg)
    if init == "from_target":
        _copy_from_target(draft, target)
    if d2t is not None:
        _reduce_head(draft, d2t)
        draft.d2t = d2t.clone()
    return draft.float().train()


def _copy_from_target(draft: Any, target: Any) -> None:
    if draft.config.hidden_size != target.config.hidden_size:
        raise DraftError(f"init=from_target needs the target's width: draft hidden_size {draft.config.hidden_size} "
                         f"!= target {target.config.hidden_size}; use init=random or hidden_size: null")
    src, dst = target.get_decoder(), draft.get_decoder()
    with torch.no_grad():
        dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
        dst.norm.weight.copy_(src.norm.weight)
        if not draft.config.tie_word_embeddings:
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight)
        n, total = draft.config.num_hidden_layers, target.config.num_hidden_layers
        same_layer = (draft.config.intermediate_size == target.config.intermediate_size
                      and draft.config.num_attention_heads == target.config.num_attention_heads
                      and draft.config.num_key_value_heads == target.config.num_key_value_heads)
        # The FIRST n layers, not evenly spaced ones: on SmolLM2-135M a 2-layer draft of layers (0, 29)
        # starts at alpha 0.0001 (the top layer fed low-level features emits huge, wrong logits), of
        # (0, 15) at 0.058, of (0, 1) at 0.075 (measured on the validation data before training).
        if same_layer:
            for i in range(min(n, total)):
                dst.layers[i].load_state_dict(src.layers[i].state_dict())


def save_draft(draft: Any, out_dir: str | Path, tokenizer: Any = None, extra: dict[str, Any] | None = None) -> None:
    """A plain HF folder (safetensors; + d2t for a reduced vocabulary), written atomically."""
    from safetensors.torch import save_file

    with atomic_path(out_dir, is_dir=True) as tmp:
        draft.save_pretrained(tmp)
        d2t = getattr(draft, "d2t", None)
        if d2t is not None:
            save_file({"d2t": d2t.to(torch.long).contiguous().cpu()}, str(Path(tmp) / D2T_FILE))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra:
            write_settings(tmp, extra)


def load_draft(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """Load a draft saved by `save_draft` (or any HF causal LM folder); `.d2t` is set for a reduced head."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise DraftError(f"no draft at {path}: train one first (`dvc repro train@draft`) or fix the path the config "
                         "names (decode.draft.path; export and serve: models.draft)")
    cfg = AutoConfig.from_pretrained(path)
    n = getattr(cfg, "draft_vocab_size", None)
    if not n:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    d2t = load_file(str(path / D2T_FILE))["d2t"]
    draft = LlamaForCausalLM(cfg)
    _reduce_head(draft, torch.arange(n))
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        if f.name != D2T_FILE:
            state.update(load_file(str(f)))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if [m for m in missing if "rotary" not in m] or unexpected:
        raise DraftError(f"draft weights at {path} do not fit its config: missing {missing}, unexpected {unexpected}")
    draft.d2t = d2t
    return draft.to(dtype).eval()


def draft_from_target(target: Any, num_layers: int) -> Any:
    """A copy of `target` truncated to its first `num_layers` decoder layers (frozen, eval mode)."""
    total = target.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise DraftError(f"draft num_layers={num_layers} must be in 1..{total} (the target's layer count)")
    draft = copy.deepcopy(target)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:num_layers])
    draft.config.num_hidden_layers = num_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = list(draft.config.layer_types)[:num_layers]
    return draft.eval().requires_grad_(False)


def check_same_vocabulary(draft: Any, target: Any) -> None:
    """The draft must predict target ids: the same vocabulary, or a reduced head with its d2t map."""
    tv = target.get_output_embeddings().weight.shape[0]
    dv = draft.get_input_embeddings().weight.shape[0]
    d2t = getattr(draft, "d2t", None)
    head = draft.get_output_embeddings().weight.shape[0]
    if dv != tv or (d2t is None and head != tv):
        raise DraftError(f"the draft's vocabulary ({dv}) differs from the target's ({tv}): a draft must share the "
                         "target's tokenizer, or come with a map from its vocabulary to the target's (d2t)")
    if d2t is not None and (len(d2t) != head or int(d2t.max()) >= tv):
        raise DraftError(f"the draft's d2t map ({len(d2t)} ids, max {int(d2t.max())}) does not fit its head ({head}) "
                         f"and the target's vocabulary ({tv})")
