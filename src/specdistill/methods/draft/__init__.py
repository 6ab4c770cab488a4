"""A separate small LM as the draft (Leviathan et al.; Chen et al.; DistillSpec): cut from the target or built
fresh, distilled on the target's answers, verified as a chain or a top-k tree; HF assisted generation and
vLLM's `draft_model` run it too when its vocabulary is the target's whole one."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from specdistill.core.errors import ConfigError
from specdistill.methods import Built, Drafting, Method, OnlineStudent, TrainContext, register, trained_folder
from specdistill.methods.draft.model import DraftSize
from specdistill.training.config import MethodConfigBase


@dataclass
class DraftMethodConfig(MethodConfigBase):
    name: str = "draft"
    init: str = "from_target"
    vocab_size: int | None = 8192
    freeze_embeddings: bool = True  # keep the target's input embeddings (init from the target; untied head)
    RANGES: ClassVar[dict[str, str]] = {"vocab_size": "[2, inf)"}  # as the heads': one token drafts nothing to learn


def check(mcfg: DraftMethodConfig) -> None:
    from specdistill.methods.draft.model import INITS

    if mcfg.init not in INITS:
        raise ConfigError(f"methods.{mcfg.name}.init={mcfg.init!r}: use one of {INITS}")


def build(ctx: TrainContext) -> Built:
    from specdistill.core.models.vocab import draft_vocabulary
    from specdistill.methods.draft.model import (
        build_draft,
        check_same_vocabulary,
        load_draft,
        save_draft,
    )
    from specdistill.methods.draft.training import DraftLMModule, OnPolicy

    mcfg: DraftMethodConfig = ctx.method
    size, data_cfg, cfg, target, datamodule = ctx.size, ctx.data, ctx.cfg, ctx.target, ctx.datamodule
    stops, pad_id, common = ctx.stops, ctx.pad_id, ctx.module_args
    if mcfg.init_from:
        draft = load_draft(mcfg.init_from).float().train().requires_grad_(True)
        check_same_vocabulary(draft, target.model)
    else:
        d2t = None
        if mcfg.vocab_size:
            d2t = draft_vocabulary(datamodule.response_tokens("train"), mcfg.vocab_size, target.vocab_size,
                                   always=sorted(stops))
        draft = build_draft(target.model, size, mcfg.init, d2t, seed=int(cfg.get("seed", 0)))
    from_target = mcfg.init == "from_target" or mcfg.init_from
    if mcfg.freeze_embeddings and from_target and not draft.config.tie_word_embeddings:
        # 28M input weights on SmolLM2 that the target already trained: no optimizer state for them
        draft.get_input_embeddings().requires_grad_(False)
    onpolicy = None
    if data_cfg.source in ("draft", "mix"):
        onpolicy = OnPolicy(fraction=1.0 if data_cfg.source == "draft" else data_cfg.mix_lambda,
                            max_new_tokens=data_cfg.max_response_tokens, stops=stops, pad_id=pad_id,
                            seed=int(cfg.get("seed", 0)))
    module = DraftLMModule(target.model, draft, onpolicy=onpolicy, **common)

    def save(out: Path, settings: dict[str, Any]) -> None:
        draft.d2t = None if module.d2t is None else module.d2t.cpu()
        save_draft(draft.eval(), out, target.tokenizer, extra=settings)

    return Built(module, draft, save)


@dataclass
class DraftDecode:
    """decode.draft (conf/decode/draft.yaml): which draft; its chain or tree is eval.k / eval.tree (shared with HF
    assisted generation)."""

    path: str | None = None  # train@draft writes models/draft; null: the target's first `layers` layers (untrained)
    layers: int = 4
    RANGES: ClassVar[dict[str, str]] = {"layers": "[1, inf)"}


def drafting(eval_cfg: Any, target: Any, dec: DraftDecode) -> Drafting:
    """A trained draft (decode.draft.path) or the target's first decode.draft.layers layers, as a chain or a
    tree."""
    from specdistill.core.models.heads_io import training_summary
    from specdistill.methods.draft.model import check_same_vocabulary, draft_from_target, load_draft
    from specdistill.methods.draft.proposer import DraftLMProposer

    model = target.model
    if dec.path:
        draft = load_draft(dec.path, dtype=model.dtype).to(target.device)
    else:
        draft = draft_from_target(model, dec.layers)
    check_same_vocabulary(draft, model)
    reduced = getattr(draft, "d2t", None) is not None
    info = {"draft": dec.path or f"target's first {dec.layers} layers",
            "draft_parameters": sum(p.numel() for p in draft.parameters()),
            "draft_vocab": len(draft.d2t) if reduced else target.vocab_size,
            "draft_training": training_summary(dec.path)}
    proposer = DraftLMProposer(draft, k=eval_cfg.k, branching=eval_cfg.tree, capacity=eval_cfg.capacity)
    return Drafting(proposer, info, max_depth=len(eval_cfg.tree) if eval_cfg.tree else eval_cfg.k,
                    assistant=None if reduced else draft)


def online(online_cfg: Any, target: Any, path: str, dec: DraftDecode | None) -> OnlineStudent:
    import torch

    from specdistill.methods.draft.model import check_same_vocabulary, load_draft, save_draft
    from specdistill.methods.draft.proposer import DraftLMProposer
    from specdistill.methods.draft.training import DraftLMModule
    from specdistill.training.losses import build_loss

    draft = load_draft(path).float().to(target.device).requires_grad_(True)
    check_same_vocabulary(draft, target.model)
    draft.get_input_embeddings().requires_grad_(False)  # as offline: the target's embeddings stay
    module = DraftLMModule(target.model, draft, loss=build_loss(online_cfg.loss), optimizer=torch.optim.AdamW,
                           teacher="stored")
    serving = copy.deepcopy(draft).to(target.model.dtype).eval().requires_grad_(False)

    def save(out: Path, requests: int) -> None:  # the deployed (serving) copy; d2t came along with deepcopy
        save_draft(serving, out, extra={"requests": requests})

    def replay(loss: Any) -> Any:
        return DraftLMModule(target.model, draft, loss=loss, optimizer=torch.optim.AdamW)

    def engine_export(out: Path, target_dir: Path) -> None:  # vLLM's draft_model: a plain HF folder, full vocabulary
        from specdistill.methods.draft.export import export_draft

        export_draft(path, out, target_dir)

    def engine_weights() -> dict[str, Any]:  # what trains, in HF names as vLLM's Llama loads them (not the frozen
        # embeddings, nor a head tied to them)
        return {k: p.detach().to(target.model.dtype) for k, p in draft.named_parameters() if p.requires_grad}

    return OnlineStudent(module, DraftLMProposer(serving, k=online_cfg.k), draft, serving, save, replay,
                         engine_export, engine_weights)


def write_export(export_cfg: Any, out: Path, target_dir: Path, load_target: Any) -> None:
    """A plain HF folder over the target's whole vocabulary (vLLM's draft_model, HF's assistant_model); the
    target itself need not load."""
    from specdistill.methods.draft.export import export_draft

    export_draft(trained_folder(export_cfg, "draft", "export"), out, target_dir)


def speculative_config(serve_cfg: Any, k: int, draft_dir: str | None) -> dict[str, Any]:
    return {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k}


def agreement_proposer(serve_cfg: Any, target: Any, k: int) -> Any:
    from specdistill.methods.draft.model import load_draft
    from specdistill.methods.draft.proposer import DraftLMProposer

    return DraftLMProposer(load_draft(trained_folder(serve_cfg, "draft", "serve"), dtype=target.model.dtype), k=k)


def describe(s: dict[str, Any]) -> tuple[str, str]:
    trained = s.get("draft_training")
    if trained:
        return "separate draft", str(trained["draft_size"])
    return "separate draft (untrained)", str(s.get("draft") or "draft")


def describe_training(s: dict[str, Any]) -> tuple[str, str]:
    layers = s["draft"]["num_layers"]
    return f"{s['draft']['name']} ({layers} layer{'s' if layers > 1 else ''})", s["method"]["init"]


register(Method("draft", __doc__, describe=describe, describe_training=describe_training, config=DraftMethodConfig,
                build=build, label=lambda mcfg, size: size.name, draft_size=DraftSize, check=check, decode=DraftDecode,
                draft=drafting,
                deterministic_branch=lambda eval_cfg, dec: None if eval_cfg.tree else "eval.tree=[...] (a top-k tree)",
                online=online, online_teacher="stored", export=write_export, speculative_config=speculative_config,
                agreement_proposer=agreement_proposer))
