"""DFlash (Chen et al., 2026): a parallel block drafter. A few layers at the target's width read the target's fused
features as injected keys and values and draft a block of block_size - 1 tokens in one forward; drafted as a chain
or a small tree of each slot's top tokens; served by vLLM (`method: dflash`) from the speculators-format export.
With `markov_rank` > 0 it is DSpark's semi-autoregressive drafter (Cheng et al., 2026): the same block plus a
low-rank Markov head, a bias on each slot from the token before it (`methods.dspark`; not served by vLLM 0.32).
With `refiner_rank` > 0 it is XPress (arXiv 2608.02438): the same block plus a causal refiner, a bias on each slot
from the tokens before it in the block and the block's states (`methods.xpress`; exported in speculators' xpress
format, which vLLM 0.32 does not serve)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from specdistill.core.errors import ConfigError
from specdistill.methods import (
    Built,
    Drafting,
    Method,
    ReferenceArgs,
    ReferenceContext,
    TrainContext,
    register,
    trained_folder,
)
from specdistill.training.config import MethodConfigBase


@dataclass
class DFlashMethodConfig(MethodConfigBase):
    name: str = "dflash"
    num_layers: int = 2  # the drafter's layers at the target's width (started from the target's last ones)
    block_size: int = 8  # slots per block: the last token and block_size - 1 masks (K = block_size - 1)
    feature_layers: list[int] | None = None  # HiddenTap indices; null: EAGLE-3's [2, L//2, L-3] (one store for both)
    vocab_size: int | None = 8192  # draft vocabulary (top-N tokens of the generated data); null: the target's
    mask_token_id: int | None = None  # the id the engine swaps for the mask embedding; null: the tokenizer's bos
    anchors: int = 32  # random anchors (blocks) per sequence per training step
    gamma: float = 4.0  # position weights exp(-(j-1)/gamma) (DFlash: 4 for blocks of 8, 7 for 16)
    step_weights: str = "decay"  # decay: the exponential above | dpace: D-PACE weights per anchor (dpace_alpha)
    dpace_alpha: float = 0.5
    markov_rank: int = 0  # DSpark's Markov head: rank of the bias from the token before each slot (0: plain DFlash)
    refiner_rank: int = 0  # XPress's causal refiner: its rank (0: none); one of the two heads at most
    refiner_mlp_ratio: int = 2  # the refiner's MLP width over its rank (the released XPress checkpoints: 2)
    consistency_passes: int = 0  # XPress: free-running rounds trained beside the teacher-forced one
    consistency_weight: float = 0.0  # their loss weight (shared among the rounds)
    base_weight: float = 0.0  # XPress: the weight of the block's own loss, without the refiner's bias
    init_layers: str = "last"  # the target's layers the drafter's start from: last | first | random
    teacher: str | None = None  # over distill.teacher for this method: live | precomputed (the features stage's store)
    RANGES: ClassVar[dict[str, str]] = {"num_layers": "[1, 16]", "block_size": "[2, 64]", "feature_layers": "[0, inf)",
                                        "markov_rank": "[0, 4096]", "refiner_rank": "[0, 4096]",
                                        "refiner_mlp_ratio": "[1, 16]", "consistency_passes": "[0, 16]",
                                        "consistency_weight": "[0, inf)", "base_weight": "[0, inf)",
                                        "vocab_size": "[2, inf)", "mask_token_id": "[0, inf)", "anchors": "[1, inf)",
                                        "gamma": "(0, inf)", "dpace_alpha": "(0, 1]"}
    STEP_WEIGHTS = ("decay", "dpace")

    def layers(self, num_layers: int) -> list[int]:
        from specdistill.core.models.hidden import fused_layers

        return list(self.feature_layers or fused_layers(num_layers))


def check(mcfg: DFlashMethodConfig) -> None:
    from specdistill.methods.dflash.model import INIT_LAYERS

    if mcfg.step_weights not in mcfg.STEP_WEIGHTS:
        raise ConfigError(f"methods.dflash.step_weights={mcfg.step_weights!r}: use one of {mcfg.STEP_WEIGHTS}")
    if mcfg.init_layers not in INIT_LAYERS:
        raise ConfigError(f"methods.{mcfg.name}.init_layers={mcfg.init_layers!r}: use one of {INIT_LAYERS}")
    if mcfg.markov_rank and mcfg.refiner_rank:
        raise ConfigError(f"methods.{mcfg.name}: markov_rank={mcfg.markov_rank} (DSpark) and refiner_rank="
                          f"{mcfg.refiner_rank} (XPress) both set: a drafter has one head, set the other to 0")
    if (mcfg.consistency_passes or mcfg.base_weight) and not mcfg.refiner_rank:
        raise ConfigError(f"methods.{mcfg.name}.consistency_passes / base_weight train XPress's refiner, and "
                          "refiner_rank is 0: set refiner_rank, or leave them at 0")


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


def build(ctx: TrainContext) -> Built:
    from specdistill.core.models.vocab import draft_vocabulary
    from specdistill.methods.dflash.model import build_dflash, load_dflash, save_dflash
    from specdistill.methods.dflash.training import DFlashModule

    mcfg: DFlashMethodConfig = ctx.method
    cfg, target, datamodule, stops, common = ctx.cfg, ctx.target, ctx.datamodule, ctx.stops, ctx.module_args
    if mcfg.init_from:
        drafter = load_dflash(mcfg.init_from, target.model, target_fingerprint=target.fingerprint)
        for head in ("markov_rank", "refiner_rank"):  # else the record would name a head the run does not train
            if getattr(drafter.cfg, head) != getattr(mcfg, head):
                raise ConfigError(f"methods.{mcfg.name}.init_from={mcfg.init_from} holds a drafter with {head}="
                                  f"{getattr(drafter.cfg, head)}, and this method sets {getattr(mcfg, head)}: start "
                                  "from a drafter with the same head, or set init_from=null")
        drafter = drafter.float().train().requires_grad_(True)
    else:
        d2t = None
        if mcfg.vocab_size:
            d2t = draft_vocabulary(datamodule.response_tokens("train"), mcfg.vocab_size, target.vocab_size,
                                   always=sorted(stops))
        drafter = build_dflash(target.model, mcfg.layers(target.model.config.num_hidden_layers), mcfg.num_layers,
                               mcfg.block_size, mask_token(mcfg, target.tokenizer, stops), d2t,
                               fingerprint=target.fingerprint, seed=int(cfg.get("seed", 0)),
                               markov_rank=mcfg.markov_rank, init_layers=mcfg.init_layers,
                               refiner_rank=mcfg.refiner_rank, refiner_mlp_ratio=mcfg.refiner_mlp_ratio)
    module = DFlashModule(target.model, drafter, anchors=mcfg.anchors, gamma=mcfg.gamma,
                          stored_layers=datamodule.stored_layers, step_weights=mcfg.step_weights,
                          dpace_alpha=mcfg.dpace_alpha, seed=int(cfg.get("seed", 0)),
                          consistency_passes=mcfg.consistency_passes, consistency_weight=mcfg.consistency_weight,
                          base_weight=mcfg.base_weight, **common)

    def save(out: Path, settings: dict[str, Any]) -> None:
        save_dflash(drafter.eval(), out, extra=settings)

    return Built(module, drafter, save)


@dataclass
class DFlashDecode:
    """decode.dflash (conf/decode/dflash.yaml): the drafter and what it drafts each round (one forward)."""

    path: str | None = None  # train@dflash writes models/dflash; or a speculators DFlash / XPress folder
    k: int | None = None  # tokens drafted per block; null: the whole block (block_size - 1)
    branching: list[int] | None = None  # a tree: the top-b tokens of each slot, b per depth (null: a chain)
    RANGES: ClassVar[dict[str, str]] = {"k": "[1, 64]", "branching": "[1, 64]"}


def drafting(eval_cfg: Any, target: Any, dec: DFlashDecode) -> Drafting:
    from specdistill.core.models.heads_io import parameter_bytes, training_summary
    from specdistill.methods.dflash.model import load_dflash
    from specdistill.methods.dflash.proposer import DFlashProposer

    if not dec.path:
        raise ConfigError("eval.method=dflash needs decode.dflash.path (train@dflash writes models/dflash)")
    model = target.model
    drafter = load_dflash(dec.path, model, dtype=model.dtype, target_fingerprint=target.fingerprint)
    try:
        proposer = DFlashProposer(drafter, k=dec.k, branching=dec.branching)
    except ValueError as e:
        raise ConfigError(f"decode.dflash.k / branching: {e}") from e
    n_params, n_bytes = parameter_bytes(drafter, model.dtype)
    info = {"draft": dec.path, "draft_parameters": n_params, "draft_bytes": n_bytes,
            "draft_vocab": drafter.cfg.draft_vocab_size or drafter.cfg.vocab_size, "block_size": drafter.cfg.block_size,
            "markov_rank": drafter.cfg.markov_rank, **({"refiner_rank": drafter.cfg.refiner_rank}
                                                        if drafter.cfg.refiner_rank else {}),
            "dflash_k": proposer.k, "dflash_branching": dec.branching,
            "draft_training": training_summary(dec.path)}
    return Drafting(proposer, info, max_depth=proposer.k)


def deterministic_branch(eval_cfg: Any, dec: DFlashDecode) -> str | None:
    return None if dec.branching else "decode.dflash.branching (a tree of each slot's top tokens)"


def write_export(export_cfg: Any, out: Path, target_dir: Path, load_target: Any) -> None:
    """The speculators DFlash format (config, tensors, the mask embedding), checked against the exported target."""
    import torch

    from specdistill.methods.dflash.export import export_dflash
    from specdistill.methods.dflash.model import load_dflash

    target = load_target()
    drafter = load_dflash(trained_folder(export_cfg, "dflash", "export"), target.model, dtype=torch.float32,
                          target_fingerprint=target.fingerprint)
    export_dflash(drafter, out, target_dir)


def max_k(draft_dir: str) -> int:
    """The export's block drafts block_size - 1 tokens."""
    import json

    return int(json.loads((Path(draft_dir) / "config.json").read_text())["block_size"]) - 1


def speculative_config(serve_cfg: Any, k: int, draft_dir: str | None) -> dict[str, Any]:
    return {"method": "dflash", "model": draft_dir, "num_speculative_tokens": k}


def agreement_proposer(serve_cfg: Any, target: Any, k: int) -> Any:
    """The engine's DFlash chain in our decoder: the argmax of slots 1..K of one block."""
    from specdistill.methods.dflash.model import load_dflash
    from specdistill.methods.dflash.proposer import DFlashProposer

    drafter = load_dflash(trained_folder(serve_cfg, "dflash", "serve"), target.model, dtype=target.model.dtype,
                          target_fingerprint=target.fingerprint)
    return DFlashProposer(drafter, k=k)


def label(mcfg: DFlashMethodConfig, size: Any) -> str:
    head = (f"-markov{mcfg.markov_rank}" if mcfg.markov_rank else "") + (
        f"-xpress{mcfg.refiner_rank}" if mcfg.refiner_rank else "")
    return f"dflash-l{mcfg.num_layers}-b{mcfg.block_size}" + head


def describe(s: dict[str, Any]) -> tuple[str, str]:
    shape = f"tree {s['dflash_branching']}" if s.get("dflash_branching") else f"chain K={s.get('dflash_k')}"
    if s.get("markov_rank"):
        return "DSpark", f"DFlash block of {s.get('block_size')} + Markov head r={s['markov_rank']}, {shape}"
    if s.get("refiner_rank"):
        return "XPress", f"DFlash block of {s.get('block_size')} + causal refiner r={s['refiner_rank']}, {shape}"
    return "DFlash", f"DFlash block of {s.get('block_size')}, {shape}"


def describe_training(s: dict[str, Any]) -> tuple[str, str]:
    m = s["method"]
    head = (f", Markov head r={m['markov_rank']}" if m.get("markov_rank") else
            f", causal refiner r={m['refiner_rank']}" if m.get("refiner_rank") else "")
    return (f"DFlash block drafter ({m['num_layers']} layer{'s' if m['num_layers'] > 1 else ''}, blocks of "
            f"{m['block_size']}{head})", "target's last layers, LM head rows")


def reference(mcfg: Any, ctx: ReferenceContext) -> ReferenceArgs:
    from specdistill.methods.dflash.reference import reference as args

    return args(mcfg, ctx, mask_token(mcfg, ctx.tokenizer, ctx.stops))


register(Method("dflash", __doc__, config=DFlashMethodConfig, build=build, label=label, reads_hidden=True,
                precomputed=True, check=check, decode=DFlashDecode, draft=drafting,
                deterministic_branch=deterministic_branch, export=write_export, speculative_config=speculative_config,
                max_k=max_k, agreement_proposer=agreement_proposer,
                describe=describe, describe_training=describe_training, reference=reference))
