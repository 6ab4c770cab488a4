"""DFlash (Chen et al., 2026): a parallel block drafter. A few layers at the target's width read the target's fused
features as injected keys and values and draft a block of block_size - 1 tokens in one forward; drafted as a chain
or a small tree of each slot's top tokens; served by vLLM (`method: dflash`) from the speculators-format export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdistill.errors import ConfigError
from specdistill.methods.registry import Built, Drafting, Method, register
from specdistill.training.dflash import DFlashMethodConfig


def check(mcfg: DFlashMethodConfig) -> None:
    if mcfg.step_weights not in mcfg.STEP_WEIGHTS:
        raise ConfigError(f"methods.dflash.step_weights={mcfg.step_weights!r}: use one of {mcfg.STEP_WEIGHTS}")


def mask_token(mcfg: DFlashMethodConfig, tokenizer: Any, stops: set[int]) -> int:
    """The id the engine swaps for the mask embedding: configured, else the tokenizer's bos. Any id serves (our
    drafter marks mask slots itself), but the engine also swaps it where it is the last token, so an id the target
    does not emit mid-answer (bos) keeps those rounds' drafts good; a stop token would not."""
    if mcfg.mask_token_id is not None:
        return int(mcfg.mask_token_id)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or bos in stops:
        raise ConfigError("methods.dflash.mask_token_id: the tokenizer has no bos token apart from its stop tokens; "
                          "set an id the target does not emit inside an answer")
    return int(bos)


def build(mcfg: DFlashMethodConfig, size: Any, dcfg: Any, cfg: dict[str, Any], target: Any, datamodule: Any,
          stops: set[int], pad_id: int, common: dict[str, Any]) -> Built:
    from specdistill.models.dflash import build_dflash, load_dflash, save_dflash
    from specdistill.models.draft_lm import draft_vocabulary
    from specdistill.training.dflash import DFlashModule

    if mcfg.init_from:
        drafter = load_dflash(mcfg.init_from, target.model, target_fingerprint=target.fingerprint)
        drafter = drafter.float().train().requires_grad_(True)
    else:
        d2t = None
        if mcfg.vocab_size:
            d2t = draft_vocabulary(datamodule.response_tokens("train"), mcfg.vocab_size, target.vocab_size,
                                   always=sorted(stops))
        drafter = build_dflash(target.model, mcfg.layers(target.model.config.num_hidden_layers), mcfg.num_layers,
                               mcfg.block_size, mask_token(mcfg, target.tokenizer, stops), d2t,
                               fingerprint=target.fingerprint, seed=int(cfg.get("seed", 0)))
    module = DFlashModule(target.model, drafter, anchors=mcfg.anchors, gamma=mcfg.gamma,
                          stored_layers=datamodule.stored_layers, step_weights=mcfg.step_weights,
                          dpace_alpha=mcfg.dpace_alpha, seed=int(cfg.get("seed", 0)), **common)

    def save(out: Path, settings: dict[str, Any]) -> None:
        save_dflash(drafter.eval(), out, extra=settings)

    return Built(module, drafter, save)


def drafting(ecfg: Any, target: Any, own: Any = None) -> Drafting:
    from specdistill.decoding.dflash import DFlashProposer
    from specdistill.models.dflash import load_dflash
    from specdistill.models.heads_io import parameter_bytes, training_summary

    if not ecfg.dflash_path:
        raise ConfigError("eval.method=dflash needs eval.dflash_path (train@dflash writes models/dflash)")
    model = target.model
    drafter = load_dflash(ecfg.dflash_path, model, dtype=model.dtype, target_fingerprint=target.fingerprint)
    try:
        proposer = DFlashProposer(drafter, k=ecfg.dflash_k, branching=ecfg.dflash_branching)
    except ValueError as e:
        raise ConfigError(f"eval.dflash_k / dflash_branching: {e}") from e
    n_params, n_bytes = parameter_bytes(drafter, model.dtype)
    info = {"draft": ecfg.dflash_path, "draft_parameters": n_params, "draft_bytes": n_bytes,
            "draft_vocab": drafter.cfg.draft_vocab_size or drafter.cfg.vocab_size, "block_size": drafter.cfg.block_size,
            "dflash_k": proposer.k, "dflash_branching": ecfg.dflash_branching,
            "draft_training": training_summary(ecfg.dflash_path)}
    return Drafting(proposer, info, max_depth=proposer.k)


def sampled_chain(ecfg: Any) -> str | None:
    return None if ecfg.dflash_branching else "eval.dflash_branching (a tree of each slot's top tokens)"


def export(ecfg: Any, out: Path, target_dir: Path, load_target: Any) -> None:
    """The speculators DFlash format (config, tensors, the mask embedding), checked against the exported target."""
    import torch

    from specdistill.export.dflash import export_dflash
    from specdistill.models.dflash import load_dflash

    target = load_target()
    drafter = load_dflash(ecfg.dflash_path, target.model, dtype=torch.float32, target_fingerprint=target.fingerprint)
    export_dflash(drafter, out, target_dir)


def max_k(draft_dir: str) -> int:
    """The export's block drafts block_size - 1 tokens."""
    import json

    return int(json.loads((Path(draft_dir) / "config.json").read_text())["block_size"]) - 1


def engine(scfg: Any, k: int, draft_dir: str | None) -> dict[str, Any]:
    return {"method": "dflash", "model": draft_dir, "num_speculative_tokens": k}


def ours(scfg: Any, target: Any, k: int) -> Any:
    """The engine's DFlash chain in our decoder: the argmax of slots 1..K of one block."""
    from specdistill.decoding.dflash import DFlashProposer
    from specdistill.models.dflash import load_dflash

    drafter = load_dflash(scfg.dflash_path, target.model, dtype=target.model.dtype,
                          target_fingerprint=target.fingerprint)
    return DFlashProposer(drafter, k=k)


def label(mcfg: DFlashMethodConfig, size: Any) -> str:
    return f"dflash-l{mcfg.num_layers}-b{mcfg.block_size}"


def describe(s: dict[str, Any]) -> tuple[str, str]:
    shape = f"tree {s['dflash_branching']}" if s.get("dflash_branching") else f"chain K={s.get('dflash_k')}"
    return "DFlash", f"DFlash block of {s.get('block_size')}, {shape}"


def describe_training(s: dict[str, Any]) -> tuple[str, str]:
    m = s["method"]
    return (f"DFlash block drafter ({m['num_layers']} layer{'s' if m['num_layers'] > 1 else ''}, blocks of "
            f"{m['block_size']})", "target's last layers, LM head rows")


register(Method("dflash", __doc__, config=DFlashMethodConfig, build=build, label=label, reads_hidden=True,
                precomputed=True, check=check, draft=drafting, sampled_chain=sampled_chain,
                export=export, engine=engine, max_k=max_k, ours=ours,
                describe=describe, describe_training=describe_training))
