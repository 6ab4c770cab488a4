"""EAGLE (Li et al., 2024-2025): a one-layer head on the frozen target's features. EAGLE-3 fuses three layers'
states and trains through its own steps (training-time test); EAGLE-1 reads the last layer and the target's
frozen LM head. Drafted as a chain, a static tree or EAGLE-2's dynamic tree; served by vLLM (`method: eagle3`)
from the speculators-format export."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from specdistill.core.errors import ConfigError
from specdistill.core.models.hidden import fused_layers
from specdistill.methods import (
    Built,
    Drafting,
    Method,
    OnlineStudent,
    ReferenceArgs,
    ReferenceContext,
    TrainContext,
    register,
    trained_folder,
)
from specdistill.training.config import MethodConfigBase


@dataclass
class EagleMethodConfig(MethodConfigBase):
    name: str = "eagle"
    variant: str = "eagle3"  # eagle1 | eagle3
    feature_layers: list[int] | None = None  # null: eagle1 [L] (the final norm's input); eagle3 [2, L//2, L-3]
    vocab_size: int | None = 8192  # draft vocabulary (top-N tokens of the generated data); null: the target's
    ttt_steps: int = 3  # training-time test: steps unrolled on the head's own states (1: EAGLE-1 training)
    step_decay: float = 0.8  # step i's loss weight decay^i
    feature_weight: float = 0.0  # eagle1: SmoothL1 on the predicted state (conf/methods/eagle1.yaml: 1.0)
    ce_weight: float = 1.0  # the token loss's weight (eagle1: through the frozen LM head, 0.1)
    noise: float = 0.0  # uniform noise in [-noise, noise] on the (unit-RMS) input features while training
    step_weights: str = "decay"  # decay: step i weighs step_decay^i | dpace: D-PACE weights per anchor (dpace_alpha)
    dpace_alpha: float = 0.5
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per fused target layer before fc (eagle3 only)
    norm_output: bool = False  # EAGLE-3.1: the next training-time-test step reads the normed output (eagle3 only)
    # methods.eagle.trainer (MethodConfigBase) matters most here: with precomputed features an EAGLE step costs
    # about half a live one, so an experiment can give EAGLE more steps in the same time (conf/experiment/)
    teacher: str | None = None  # over distill.teacher for this method: live | precomputed (the features stage's store)
    RANGES: ClassVar[dict[str, str]] = {"feature_layers": "[0, inf)", "vocab_size": "[2, inf)", "ttt_steps": "[1, 16]",
                                        "step_decay": "(0, 1]", "feature_weight": "[0, inf)", "ce_weight": "[0, inf)",
                                        "noise": "[0, inf)", "dpace_alpha": "(0, 1]"}
    STEP_WEIGHTS = ("decay", "dpace")

    def layers(self, num_layers: int) -> list[int]:
        """The HiddenTap indices the head reads: feature_layers, or the variant's default for this target."""
        return list(self.feature_layers or ([num_layers] if self.variant == "eagle1" else fused_layers(num_layers)))


def check(mcfg: EagleMethodConfig) -> None:
    from specdistill.methods.eagle.model import VARIANTS

    if mcfg.variant not in VARIANTS:
        raise ConfigError(f"methods.{mcfg.name}.variant={mcfg.variant!r}: use one of {VARIANTS}")
    if mcfg.step_weights not in mcfg.STEP_WEIGHTS:
        raise ConfigError(f"methods.{mcfg.name}.step_weights={mcfg.step_weights!r}: use one of {mcfg.STEP_WEIGHTS}")
    if mcfg.variant != "eagle3" and (mcfg.fc_norm or mcfg.norm_output):
        raise ConfigError(f"methods.{mcfg.name}.fc_norm / norm_output are EAGLE-3.1 flags, for variant eagle3 only "
                          f"(this one is {mcfg.variant}): set them false")


def build(ctx: TrainContext) -> Built:
    from specdistill.core.models.vocab import draft_vocabulary
    from specdistill.methods.eagle.model import build_eagle, load_eagle, save_eagle
    from specdistill.methods.eagle.training import EagleModule

    mcfg: EagleMethodConfig = ctx.method
    cfg, target, datamodule, stops, common = ctx.cfg, ctx.target, ctx.datamodule, ctx.stops, ctx.module_args
    if mcfg.init_from:
        head = load_eagle(mcfg.init_from, target.model, target_fingerprint=target.fingerprint).float().train()
        head.requires_grad_(True)
        if head.cfg.variant == "eagle1":
            head.norm.requires_grad_(False)
            head.lm_head.requires_grad_(False)
    else:
        d2t = None
        if mcfg.vocab_size:
            d2t = draft_vocabulary(datamodule.response_tokens("train"), mcfg.vocab_size, target.vocab_size,
                                   always=sorted(stops))
        layers = mcfg.layers(target.model.config.num_hidden_layers)
        head = build_eagle(target.model, mcfg.variant, layers, d2t, fingerprint=target.fingerprint,
                           seed=int(cfg.get("seed", 0)), fc_norm=mcfg.fc_norm, norm_output=mcfg.norm_output)
    module = EagleModule(target.model, head, ttt_steps=mcfg.ttt_steps, step_decay=mcfg.step_decay,
                         feature_weight=mcfg.feature_weight, ce_weight=mcfg.ce_weight, noise=mcfg.noise,
                         stored_layers=datamodule.stored_layers, step_weights=mcfg.step_weights,
                         dpace_alpha=mcfg.dpace_alpha, **common)

    def save(out: Path, settings: dict[str, Any]) -> None:
        save_eagle(head.eval(), out, extra=settings)  # + eagle3/: the serving-engine layout

    return Built(module, head, save)


@dataclass
class EagleDecode:
    """decode.eagle (conf/decode/eagle.yaml): the head and its draft tree (methods/eagle/proposer.py EagleTreeConfig),
    checked here, before the target loads."""

    # train@eagle writes models/eagle (eagle3), train@eagle1 models/eagle1; or a speculators-format EAGLE-3 folder
    # (our export, or any speculators trainer's checkpoint)
    path: str | None = None
    tree: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tree_config()

    def tree_config(self) -> Any:
        from specdistill.methods.eagle.proposer import EagleTreeConfig

        try:
            return EagleTreeConfig(**self.tree)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"decode.eagle.tree: {e}") from e


def drafting(eval_cfg: Any, target: Any, dec: EagleDecode) -> Drafting:
    from dataclasses import asdict

    from specdistill.core.models.heads_io import parameter_bytes, training_summary
    from specdistill.methods.eagle.model import load_eagle
    from specdistill.methods.eagle.proposer import EagleProposer

    if not dec.path:
        raise ConfigError("eval.method=eagle needs decode.eagle.path (train@eagle writes models/eagle)")
    model = target.model
    head = load_eagle(dec.path, model, dtype=model.dtype, target_fingerprint=target.fingerprint)
    eagle = EagleProposer(head, dec.tree_config(), capacity=eval_cfg.capacity)
    n_params, n_bytes = parameter_bytes(head, model.dtype)
    info = {"draft": dec.path, "draft_parameters": n_params, "draft_bytes": n_bytes,
            "draft_vocab": head.cfg.draft_vocab_size or head.cfg.vocab_size, "eagle_variant": label(head.cfg, None),
            "eagle_tree": asdict(eagle.tree), "draft_training": training_summary(dec.path)}
    depth = max(eagle.tree.k, eagle.tree.depth, len(eagle.tree.branching or []))
    return Drafting(eagle, info, max_depth=depth)


def deterministic_branch(eval_cfg: Any, dec: EagleDecode) -> str | None:
    return "decode.eagle.tree.shape=dynamic (or static)" if dec.tree_config().shape == "chain" else None


def online(online_cfg: Any, target: Any, path: str, dec: EagleDecode) -> OnlineStudent:
    import torch

    from specdistill.core.models.heads_io import read_settings
    from specdistill.methods.eagle.model import load_eagle, save_eagle
    from specdistill.methods.eagle.proposer import EagleProposer
    from specdistill.methods.eagle.training import EagleModule
    from specdistill.training.losses import build_loss

    head = load_eagle(path, target.model, target_fingerprint=target.fingerprint).float().train().requires_grad_(True)
    if head.cfg.variant == "eagle1":
        head.norm.requires_grad_(False)
        head.lm_head.requires_grad_(False)
    trained = read_settings(path).get("method", {})
    module = EagleModule(target.model, head, ttt_steps=int(trained.get("ttt_steps", 1)),
                         feature_weight=float(trained.get("feature_weight", 0.0)),
                         ce_weight=float(trained.get("ce_weight", 1.0)), loss=build_loss(online_cfg.loss),
                         optimizer=torch.optim.AdamW, teacher="live")
    serving = load_eagle(path, target.model, dtype=target.model.dtype, target_fingerprint=target.fingerprint)

    def save(out: Path, requests: int) -> None:
        save_eagle(serving, out, extra={"requests": requests})

    def engine_export(out: Path, target_dir: Path) -> None:  # speculators' EAGLE-3 folder, which vLLM loads
        from specdistill.methods.eagle.export import export_eagle3

        export_eagle3(head, out, target_dir)

    def engine_weights() -> dict[str, Any]:  # the export's tensors and names, less the fixed vocabulary maps
        from specdistill.methods.eagle.export import eagle3_state

        state, _ = eagle3_state(head)
        return {k: v.to(target.model.dtype) for k, v in state.items() if k not in ("d2t", "t2d")}

    # dec None: the engine drafts (online_engine), no proposer of ours
    proposer = EagleProposer(serving, dec.tree_config()) if dec is not None else None
    return OnlineStudent(module, proposer, head, serving, save, engine_export=engine_export,
                         engine_weights=engine_weights)


def write_export(export_cfg: Any, out: Path, target_dir: Path, load_target: Any) -> None:
    """EAGLE-3 in the speculators format vLLM loads natively, checked against the exported target."""
    import torch

    from specdistill.methods.eagle.export import export_eagle3
    from specdistill.methods.eagle.model import load_eagle

    target = load_target()
    head = load_eagle(trained_folder(export_cfg, "eagle", "export"), target.model, dtype=torch.float32,
                      target_fingerprint=target.fingerprint)
    export_eagle3(head, out, target_dir, num_speculative_tokens=export_cfg.num_speculative_tokens)


def speculative_config(serve_cfg: Any, k: int, draft_dir: str | None) -> dict[str, Any]:
    return {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": k}


def agreement_proposer(serve_cfg: Any, target: Any, k: int) -> Any:
    from specdistill.methods.eagle.model import load_eagle
    from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig

    head = load_eagle(trained_folder(serve_cfg, "eagle", "serve"), target.model, dtype=target.model.dtype,
                      target_fingerprint=target.fingerprint)
    return EagleProposer(head, EagleTreeConfig(shape="chain", k=k))


FAMILIES = {"eagle1": "EAGLE-1", "eagle3": "EAGLE-3", "eagle3.1": "EAGLE-3.1"}


def describe(s: dict[str, Any]) -> tuple[str, str]:
    variant, t = s.get("eagle_variant"), s.get("eagle_tree") or {}
    shape = {"dynamic": f"dynamic tree {t.get('total_tokens')} nodes", "chain": f"chain K={t.get('k')}"}.get(
        t.get("shape"), f"static tree {t.get('branching')}")
    return FAMILIES.get(variant, f"EAGLE ({variant})"), f"{variant}, {shape}"


def describe_training(s: dict[str, Any]) -> tuple[str, str]:
    m = s["method"]
    variant = label(EagleMethodConfig(**{k: m[k] for k in ("variant", "fc_norm", "norm_output") if k in m}), None)
    student = f"EAGLE head ({variant}, 1 layer{', TTT ' + str(m['ttt_steps']) if m['ttt_steps'] > 1 else ''})"
    return student, ("target's last layer + LM head" if m["variant"] == "eagle1"
                     else "random layer, target's LM head rows")


def label(mcfg: Any, size: Any) -> str:
    """eagle1, eagle3, or eagle3.1 (both EAGLE-3.1 flags; one alone is named)."""
    if mcfg.fc_norm and mcfg.norm_output:
        return "eagle3.1"
    return mcfg.variant + ("-fc_norm" if mcfg.fc_norm else "") + ("-norm_output" if mcfg.norm_output else "")


def report_tables(runs: dict[str, Any], evaluated: dict[str, Any]) -> list[str]:
    from specdistill.methods.eagle.report import training_tables

    return training_tables(runs, evaluated)


def reference(mcfg: Any, ctx: ReferenceContext) -> ReferenceArgs:
    from specdistill.methods.eagle.reference import reference as args

    return args(mcfg, ctx)


register(Method("eagle", __doc__, config=EagleMethodConfig, build=build, label=label,
                reads_hidden=True, precomputed=True, check=check,
                decode=EagleDecode, draft=drafting, online=online, export=write_export,
                deterministic_branch=deterministic_branch, speculative_config=speculative_config,
                agreement_proposer=agreement_proposer, describe=describe, describe_training=describe_training,
                training_tables=report_tables, reference=reference))
