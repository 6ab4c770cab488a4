"""Medusa-1 (Cai et al., 2024): K residual heads on the frozen target's last hidden state, head k predicting the
token k + 1 ahead, verified as a tree grown from the heads' per-rank accuracies."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from specdistill.core.errors import ConfigError
from specdistill.methods import Built, Drafting, Method, TrainContext, register, trained_folder
from specdistill.training.config import MethodConfigBase


@dataclass
class MedusaMethodConfig(MethodConfigBase):
    name: str = "medusa"
    num_heads: int = 4  # K
    num_layers: int = 1  # residual blocks per head
    vocab_size: int | None = 8192  # reduced head over the most frequent tokens (d2t); null: the full vocabulary
    decay: float = 0.8  # head k's loss weight decay^k
    max_rank: int = 10  # candidate ranks measured per head (the tree builder's acc[k][i])
    tree_budgets: list[int] = field(default_factory=lambda: [16, 32, 64])  # trees saved beside the heads
    RANGES: ClassVar[dict[str, str]] = {"num_heads": "[1, 16]", "num_layers": "[1, inf)", "vocab_size": "[2, inf)",
                                        "decay": "(0, 1]", "max_rank": "[1, inf)", "tree_budgets": "[1, inf)"}


def build(ctx: TrainContext) -> Built:
    from specdistill.core.models.vocab import draft_vocabulary
    from specdistill.methods.medusa.model import build_medusa, load_medusa, save_medusa
    from specdistill.methods.medusa.training import MedusaModule

    mcfg: MedusaMethodConfig = ctx.method
    target, datamodule, stops, common = ctx.target, ctx.datamodule, ctx.stops, ctx.module_args
    if mcfg.init_from:
        heads = load_medusa(mcfg.init_from, target_fingerprint=target.fingerprint, target=target.model)
        heads = heads.float().train().requires_grad_(True)
    else:
        d2t = None
        if mcfg.vocab_size:
            d2t = draft_vocabulary(datamodule.response_tokens("train"), mcfg.vocab_size, target.vocab_size,
                                   always=sorted(stops))
        heads = build_medusa(target.model, mcfg.num_heads, mcfg.num_layers, d2t, fingerprint=target.fingerprint)
    module = MedusaModule(target.model, heads, decay=mcfg.decay, max_rank=mcfg.max_rank,
                          tree_budgets=mcfg.tree_budgets, **common)

    def save(out: Path, settings: dict[str, Any]) -> None:
        save_medusa(heads.eval(), out, extra=settings, trees=module.trees())

    return Built(module, heads, save, record=lambda: {"trees": module.trees()})


@dataclass
class MedusaDecode:
    """decode.medusa (conf/decode/medusa.yaml): the heads and the tree verified each round."""

    path: str | None = None  # train@medusa writes models/medusa (heads + tree.json)
    budget: int = 12  # tree nodes: a saved tree, or one grown from the saved accuracies
    choices: list[list[int]] | None = None  # an explicit Medusa tree instead of a saved one
    RANGES: ClassVar[dict[str, str]] = {"budget": "[1, inf)"}


def choices(dec: MedusaDecode) -> list[tuple[int, ...]]:
    """The Medusa tree to verify: explicit choices, the saved tree of `budget` nodes, or one grown to that budget
    from the per-rank accuracies saved beside the heads."""
    from specdistill.methods.medusa.model import load_trees
    from specdistill.methods.medusa.tree import grow_tree, sort_choices

    if dec.choices:
        return sort_choices(dec.choices)
    saved = load_trees(dec.path)
    if str(dec.budget) in saved["trees"]:
        return sort_choices(saved["trees"][str(dec.budget)]["choices"])
    if "acc" in saved:
        return grow_tree(saved["acc"], dec.budget)
    raise ConfigError(f"decode.medusa.budget={dec.budget}: {dec.path} has trees of "
                      f"{sorted(int(b) for b in saved['trees'])} nodes and no accuracies to grow another; "
                      "give decode.medusa.choices")


def drafting(eval_cfg: Any, target: Any, dec: MedusaDecode) -> Drafting:
    from specdistill.core.models.heads_io import parameter_bytes, training_summary
    from specdistill.methods.medusa.model import load_medusa
    from specdistill.methods.medusa.proposer import MedusaProposer

    if not dec.path:
        raise ConfigError("eval.method=medusa needs decode.medusa.path (train@medusa writes models/medusa)")
    model = target.model
    heads = load_medusa(dec.path, dtype=model.dtype, target_fingerprint=target.fingerprint,
                        target=model).to(target.device)
    tree = choices(dec)
    n_params, n_bytes = parameter_bytes(heads, model.dtype)
    info = {"draft": dec.path, "draft_parameters": n_params, "draft_bytes": n_bytes,
            "draft_vocab": heads.cfg.draft_vocab_size or heads.cfg.vocab_size, "medusa_heads": heads.num_heads,
            "tree_nodes": len(tree), "medusa_choices": [list(c) for c in tree],
            "draft_training": training_summary(dec.path)}
    return Drafting(MedusaProposer(heads, tree), info, max_depth=heads.num_heads)


def write_export(export_cfg: Any, out: Path, target_dir: Path, load_target: Any) -> None:
    """vLLM's Medusa layout (a reduced head as its token map), checked against the exported target; the target
    itself need not load."""
    from specdistill.methods.medusa.export import export_medusa
    from specdistill.methods.medusa.model import load_medusa

    export_medusa(load_medusa(trained_folder(export_cfg, "medusa", "export")), out, target_dir)


def max_k(draft_dir: str) -> int:
    """The export's number of heads: vLLM drafts one token per head."""
    import json

    return int(json.loads((Path(draft_dir) / "config.json").read_text())["num_heads"])


def speculative_config(serve_cfg: Any, k: int, draft_dir: str | None) -> dict[str, Any]:
    """vLLM drafts the first K heads' top-1 tokens (K up to `max_k`: the serve stage leaves out the rest)."""
    return {"method": "medusa", "model": draft_dir, "num_speculative_tokens": k}


def agreement_proposer(serve_cfg: Any, target: Any, k: int) -> Any:
    """The engine's Medusa chain in our decoder: the top-1 of heads 1..K."""
    from specdistill.methods.medusa.model import load_medusa
    from specdistill.methods.medusa.proposer import MedusaProposer

    heads = load_medusa(trained_folder(serve_cfg, "medusa", "serve"), dtype=target.model.dtype,
                        target_fingerprint=target.fingerprint, target=target.model).to(target.device)
    return MedusaProposer(heads, [(0,) * d for d in range(1, k + 1)])


def report_tables(runs: dict[str, Any], evaluated: dict[str, Any]) -> list[str]:
    from specdistill.methods.medusa.report import training_tables

    return training_tables(runs, evaluated)


def describe(s: dict[str, Any]) -> tuple[str, str]:
    return "Medusa", f"Medusa {s.get('medusa_heads')} heads, {s.get('tree_nodes')}-node tree"


def describe_training(s: dict[str, Any]) -> tuple[str, str]:
    m = s["method"]
    return f"Medusa, {m['num_heads']} heads x {m['num_layers']} block", "target's LM head"


register(Method("medusa", __doc__, config=MedusaMethodConfig, build=build,
                label=lambda mcfg, size: f"k{mcfg.num_heads}", reads_hidden=True, decode=MedusaDecode,
                draft=drafting,
                deterministic_branch=lambda eval_cfg, dec: None,  # its tree is deterministic
                export=write_export, speculative_config=speculative_config, max_k=max_k,
                agreement_proposer=agreement_proposer,
                describe=describe, describe_training=describe_training, training_tables=report_tables))
