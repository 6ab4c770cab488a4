"""evaluate: speculative decoding on MT-bench and HumanEval; tau, alpha per position, speed-up.

Writes `metrics/records/<method>.json` (every number with the settings that produced it), its headline
`metrics/<method>.json` (tau and speed-up per dataset and temperature: what `dvc metrics show` prints) and
`plots/<method>/` (acceptance by position and speed CSVs, sample outputs).
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from specdistill import methods
from specdistill.core.config import section
from specdistill.core.hardware import environment
from specdistill.core.io import atomic_path
from specdistill.core.models.target import TargetConfig, load_target
from specdistill.core.records import headline_of_evaluation, metrics_files, rival_names, write_record
from specdistill.core.stage import ConfigError, check_outputs
from specdistill.core.tracking import wandb_run
from specdistill.decoding.union import UnionProposer
from specdistill.evaluation.autotune import Capped, choose_depth
from specdistill.evaluation.contention import Contention, busy_warning
from specdistill.evaluation.prompts import SPLITS, chat_encoder, check_eval_sets, load_conversations, stratified_order  # noqa: F401
from specdistill.evaluation.runner import hf_method, our_method, run_benchmark

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    method: str = "draft"  # draft: a separate draft LM | medusa: Medusa heads | eagle: an EAGLE head | lookup
    name: str | None = None  # outputs' name: metrics/<name>.json, plots/<name>/; default the method
    datasets: list[str] = field(default_factory=lambda: ["mtbench", "humaneval"])
    num_prompts: int = 5  # per dataset; MT-bench prompts run both turns
    # test: num_prompts of each set, its categories in turn (every reported figure) | dev: num_prompts others with
    # the same mix of categories, disjoint from them, to tune decoding settings on (the reported prompts stay unseen)
    split: str = "test"
    max_new_tokens: int = 96
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    top_p: float = 1.0
    top_k: int = 0
    k: int = 2  # draft chain length
    tree: list[int] | None = None  # branching per depth for a top-k draft tree instead of a chain
    depth: int | str | None = None  # a cap on the draft's depth | "auto": depth and width chosen from measured costs
    width: int | None = None  # a cap on each node's children (1: the tree's path of first children, a chain)
    pilot_prompts: int = 1  # dev prompts per dataset the eval.depth=auto pilot decodes (more: a steadier tau, slower)
    pilot_tokens: int = 48  # per pilot generation: enough rounds to count acceptance by position, a few seconds each
    hf_baselines: bool = True  # HF generate and HF assisted generation beside ours
    # companions (methods.companions(): prompt lookup, suffix decoding; nothing trained, deterministic trees):
    # beside: each reported alone in the same run, a baseline on the same prompts (evaluate@draft: lookup);
    # branch: one verified with the method's draft as one tree (decoding/union.py): lookup copies the spans an answer
    # repeats from its prompt or earlier turn, where a small draft is weak (evaluate@eagle_lookup)
    beside: list[str] = field(default_factory=list)
    branch: str | None = None
    # rivals: other evaluate items (keys of `evals`) whose drafts run in this same run beside the method's, on the
    # same prompts, interleaved, against the same AR: a head-to-head without the drift between runs (stage compare:
    # EAGLE-3 against EAGLE-3.1 and the block drafters). A rival drafts as its own item says (its method, decode, k,
    # tree, and its depth / width, which only its item sets: eval.depth=auto pilots it on the run's dev prompts);
    # what the run measures (prompts, tokens, temperatures) is this item's
    rivals: list[str] = field(default_factory=list)
    decode: dict[str, Any] = field(default_factory=dict)  # an item's keys over decode.<method> (evals.<item>.decode)
    capacity: int = 4096  # KV cache tokens per generation
    seed: int = 0
    RANGES: ClassVar[dict[str, str]] = {  # checked by `section` at the stage's start, with the key named
        "num_prompts": "[1, inf)", "max_new_tokens": "[1, inf)", "temperatures": "[0, 2]", "top_p": "(0, 1]",
        "top_k": "[0, inf)", "k": "[1, 64]", "tree": "[1, 64]", "depth": "[0, 64]", "width": "[1, 64]",
        "pilot_prompts": "[1, inf)", "pilot_tokens": "[1, inf)", "capacity": "[64, inf)"}

    def __post_init__(self) -> None:
        methods.get(self.method, "evaluate", "eval.method")
        for key, name in [*(("eval.beside", n) for n in self.beside), ("eval.branch", self.branch)]:
            if name is not None and name not in methods.companions():
                raise ConfigError(f"{key}: {name!r} is not a companion: use one of {methods.companions()} (a method "
                                  "that drafts deterministic trees from nothing trained)")
        if self.split not in SPLITS:
            raise ConfigError(f"eval.split={self.split!r}: use one of {SPLITS}")
        if self.capacity <= self.max_new_tokens + 64:  # the answer, a draft of up to 64 positions, and a prompt
            raise ConfigError(f"`eval.capacity={self.capacity}` cannot hold "
                              f"`eval.max_new_tokens={self.max_new_tokens}` with a prompt and a draft: raise "
                              f"eval.capacity above max_new_tokens + 64 (the default 4096 holds any benchmark "
                              f"prompt), or lower eval.max_new_tokens")
        check_eval_sets(self.datasets, "eval.datasets")
        if isinstance(self.depth, str) and self.depth != "auto":
            raise ConfigError(f"eval.depth={self.depth!r}: a depth (0 = plain AR), auto, or null (the method's own)")
        if self.depth == "auto" and self.width is not None:
            raise ConfigError(f"eval.depth=auto chooses the width too: drop eval.width={self.width}, or set a depth")
        if clash := set(self.rivals) & ({*ROWS, *self.beside, self.name or self.method}):
            raise ConfigError(f"eval.rivals={self.rivals}: {sorted(clash)} would share a name with the run, a "
                              f"companion beside it or a row ({ROWS}): name another evaluate item")
        if len(set(self.rivals)) < len(self.rivals):
            raise ConfigError(f"eval.rivals={self.rivals} names an item twice: list each once")


# the rows every run may have (companions and rivals add theirs)
ROWS = ("ar", "spec", "hf_generate", "hf_assisted")
# what a rival must share with the item it runs in: the run's measurement, not the draft
SHARED = ("datasets", "num_prompts", "split", "max_new_tokens", "temperatures", "top_p", "top_k", "capacity", "seed",
          "pilot_prompts", "pilot_tokens")



def run(cfg: dict[str, Any]) -> dict[str, Any]:
    eval_cfg = section(EvalConfig, eval_item(cfg), "eval")
    # how the method drafts and how its companions do (their rows, its branch): checked before the target loads
    dec = methods.decode_settings(cfg, eval_cfg.method, eval_cfg.decode)
    named = dict.fromkeys([*eval_cfg.beside, *([eval_cfg.branch] if eval_cfg.branch else [])])
    companions = {n: methods.decode_settings(cfg, n) for n in named}
    check_branch(eval_cfg, dec)
    rivals = {r: rival_item(cfg, eval_cfg, r) for r in eval_cfg.rivals}  # each item's eval section and decode settings
    target_cfg = section(TargetConfig, dict(cfg["target"]), "target")
    name = eval_cfg.name or eval_cfg.method
    metrics_file = Path((cfg.get("paths") or {}).get("metrics_dir", "metrics")) / f"{name}.json"
    reads = {f"decode.{eval_cfg.method}.path": getattr(dec, "path", None),
             **{f"decode.{n}.path": getattr(d, "path", None) for n, d in companions.items()},
             **{f"evals.{r}.decode.path": getattr(rd, "path", None) for r, (_, rd) in rivals.items()}}
    check_outputs(cfg, names={"eval.name": name},
                  replaced={"eval.name": Path((cfg.get("paths") or {}).get("plots_dir", "plots")) / name},
                  files={"eval.name": metrics_files(metrics_file)}, inputs=reads)
    # the prompts first: a missing split or an overlapping dev set fails before the target loads
    data = {name: load_conversations(Path(cfg["paths"]["prompts_dir"]), name, eval_cfg.num_prompts, eval_cfg.split)
            for name in eval_cfg.datasets}
    # eval.depth=auto pilots on dev prompts: disjoint from the reported test prompts, as tuning must be
    autos = eval_cfg.depth == "auto" or any(rc.depth == "auto" for rc, _ in rivals.values())
    pilot = pilot_conversations(eval_cfg, Path(cfg["paths"]["prompts_dir"])) if autos else []
    target = load_target(target_cfg)
    tok, model = target.tokenizer, target.model
    stops = target.stop_ids
    encode = chat_encoder(tok)
    # the method's own proposer and its companions' (missing heads, trees or corpora fail here, before any decoding)
    drafting = methods.get(eval_cfg.method, "evaluate", "eval.method").draft(eval_cfg, target, dec)
    drafts = {n: methods.get(n, "evaluate").draft(eval_cfg, target, d) for n, d in companions.items()}
    rival_drafts = {r: methods.get(rc.method, "evaluate").draft(rc, target, rd) for r, (rc, rd) in rivals.items()}
    reach = lambda e, d: max(e.tree and len(e.tree) or e.k, d.max_depth)  # noqa: E731 (positions a draft can reach)
    max_pos = max([reach(eval_cfg, drafting), *(d.max_depth for d in drafts.values()),
                   *(reach(rc, rival_drafts[r]) for r, (rc, _) in rivals.items())])
    ours = lambda name, proposer: our_method(name, model, proposer, eval_cfg.max_new_tokens, stops,  # noqa: E731
                                             eval_cfg.capacity, max_pos)
    spec = drafting.proposer
    if eval_cfg.branch:  # the draft and the companion's tree verified as one
        spec = UnionProposer(spec, drafts[eval_cfg.branch].proposer)
    deepest = max(drafting.max_depth, drafts[eval_cfg.branch].max_depth if eval_cfg.branch else 0)
    shaped = lambda e, proposer, deepest: shape(e, model, proposer, deepest, pilot, encode, stops)  # noqa: E731
    busy = Contention().start()  # what else ran on our CPUs from the pilots to the last decoded token
    spec, auto = shaped(eval_cfg, spec, deepest)
    rival_shapes = {r: shaped(rc, rival_drafts[r].proposer, rival_drafts[r].max_depth) for r, (rc, _) in rivals.items()}
    pad = target.pad_id
    rows = [ours("ar", None)]
    if eval_cfg.hf_baselines:
        rows.append(hf_method("hf_generate", model, eval_cfg.max_new_tokens, stops, pad))
    rows.append(ours("spec", spec))
    if eval_cfg.hf_baselines and drafting.assistant is not None:  # HF assisted generation needs the full vocabulary
        rows.append(hf_method("hf_assisted", model, eval_cfg.max_new_tokens, stops, pad, assistant=drafting.assistant,
                              k=eval_cfg.k))
    rows += [ours(n, drafts[n].proposer) for n in eval_cfg.beside]  # named after the method: the report describes them
    rows += [ours(r, proposer) for r, (proposer, _) in rival_shapes.items()]  # named after the item
    draft_info = drafting.info

    group = cfg.get("experiment_name", "default")
    if auto:
        draft_info = {**draft_info, "auto_depth": auto}
    settings = {"method": eval_cfg.method, **asdict(eval_cfg), "decode": asdict(dec) if dec is not None else {},
                **{n: asdict(d) for n, d in companions.items()}, **draft_info,
                "chain_or_tree": "tree" if eval_cfg.tree else "chain",
                "rivals": {r: {"method": rc.method, "k": rc.k, "tree": rc.tree, "order": i, "depth": rc.depth,
                               "width": rc.width, "decode": asdict(rd) if rd is not None else {},
                               **rival_drafts[r].info,
                               **({"auto_depth": rival_shapes[r][1]} if rival_shapes[r][1] else {})}
                           for i, (r, (rc, rd)) in enumerate(rivals.items())},
                "prompts": {k: len(v) for k, v in data.items()}, "dtype": target_cfg.dtype,
                "target_fingerprint": target.fingerprint, **environment()}
    with wandb_run(cfg.get("logger"), job_type="evaluate", name=f"evaluate@{name}", group=group, config=cfg) as wb:
        res = run_benchmark(rows, data, eval_cfg.temperatures, eval_cfg.top_p, eval_cfg.top_k, encode, tok.decode,
                            eval_cfg.seed)
        settings["others_cpu_share"] = busy.stop()
        if warning := busy_warning(settings["others_cpu_share"], f"evaluate@{name}"):
            log.warning(warning)
        metrics = summarise(res, eval_cfg.method, settings)
        paths = cfg.get("paths") or {}
        write_outputs(metrics, res, name, Path(paths.get("metrics_dir", "metrics")),
                      Path(paths.get("plots_dir", "plots")))
        log_wandb(wb, metrics)
    for ds_name, temps in metrics["results"].items():
        for temp, m in temps.items():
            for r in (r for r in rivals if r in m):
                log.info("%s %s: rival %s: tau %.2f, speed-up %.2fx over AR", ds_name, temp, r, m[r].get("tau", 1),
                         m[r].get("speedup", 0))
            spec = m["spec"]
            log.info("%s %s: tau %.2f, speed-up %.2fx over AR (%.1f vs %.1f tok/s)%s", ds_name, temp,
                     spec.get("tau", 1), spec.get("speedup", 0), spec["tokens_per_s"], m["ar"]["tokens_per_s"],
                     f", {spec['tokens_per_s'] / m['hf_assisted']['tokens_per_s']:.2f}x HF assisted"
                     if "hf_assisted" in m else "")
    return metrics


def check_branch(eval_cfg: EvalConfig, dec: Any) -> None:
    """eval.branch: the method must take a branch, and draft deterministically where it samples."""
    if not eval_cfg.branch:
        return
    method = methods.get(eval_cfg.method, "evaluate", "eval.method")
    if method.deterministic_branch is None:
        takes = [n for n in methods.names("evaluate") if methods.find(n).deterministic_branch]
        raise ConfigError(f"eval.branch={eval_cfg.branch} adds a companion's tree to the method's draft: set "
                          f"eval.method to one of {takes}, or eval.branch=null (method={eval_cfg.method} takes no "
                          "branch)")
    fix = method.deterministic_branch(eval_cfg, dec)  # a chain sampled at T > 0 cannot merge with a deterministic tree
    if fix and any(t > 0 for t in eval_cfg.temperatures):
        raise ConfigError(f"eval.branch={eval_cfg.branch} merges deterministic trees, but method={eval_cfg.method} "
                          f"drafts a chain by sampling at temperature > 0: use {fix}, or eval.temperatures=[0.0]")


def rival_item(cfg: dict[str, Any], eval_cfg: EvalConfig, rival: str) -> tuple[EvalConfig, Any]:
    """evals.<rival> as the run's rival: its eval section (its draft's keys over the shared ones) and its decode
    settings, checked before the target loads; it must measure what the run measures and draft nothing extra."""
    if rival not in (cfg.get("evals") or {}):
        raise ConfigError(f"eval.rivals: {rival!r} is no evaluate item: use keys of evals "
                          f"({sorted(cfg.get('evals') or {})})")
    item = cfg["evals"][rival] or {}
    methods.get(item.get("method"), "evaluate", f"evals.{rival}.method")
    own = ("beside", "branch", "rivals")  # a rival runs none of these: only its item may set them
    # the run's measurement (its item's keys included) under the rival's item: a key the item sets apart is refused.
    # Its shape is its item's alone: a run-wide eval.depth=auto would turn the fixed-shape rivals into chosen ones
    base = {**{k: v for k, v in cfg["eval"].items() if k not in (*own, "depth", "width")},
            **{k: getattr(eval_cfg, k) for k in SHARED}, "name": rival, "method": None}
    try:
        rc = section(EvalConfig, eval_item({**cfg, "eval": base}), f"evals.{rival}")
    except ConfigError as e:  # the checks of EvalConfig itself name `eval.<key>`: say which item set it
        raise ConfigError(f"eval.rivals: evals.{rival}: {e}") from None
    if extra := [k for k in own if getattr(rc, k) not in (None, [])]:
        raise ConfigError(f"eval.rivals: evals.{rival} sets {extra}, which a rival does not run (it drafts with its "
                          "own method, decode, k, tree, depth and width only): name an item without them")
    if differ := [k for k in SHARED if getattr(rc, k) != getattr(eval_cfg, k)]:
        raise ConfigError(f"eval.rivals: evals.{rival} sets {differ} apart from this run's "
                          f"({', '.join(f'{k}={getattr(eval_cfg, k)!r}' for k in differ)}): a rival measures on the "
                          f"run's prompts and settings: drop them from evals.{rival}")
    return rc, methods.decode_settings(cfg, rc.method, rc.decode)


def items(cfg: dict[str, Any]) -> dict[str, Any]:
    """The evaluate items by `eval.name`: the `evals` entries, and `compare`, the head to head, which has a section
    of its own (dvc.yaml's compare stage names its four models; a foreach item over evals cannot)."""
    return {**(cfg.get("evals") or {}), **({"compare": cfg["compare"]} if cfg.get("compare") else {})}


def eval_item(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `eval` section with its item's keys over it (`evals.<eval.name or eval.method>`, the DVC item's
    config): an item's key wins over the shared section's, and the log says where it did."""
    shared = dict(cfg["eval"])
    key = shared.get("name") or shared.get("method")
    item = items(cfg).get(key) or {}
    item = {k: v for k, v in item.items() if k != "inputs"}  # what its DVC stage waits for: nothing the run reads
    for k in sorted(set(item) & set(shared)):
        if item[k] != shared[k] and k != "method":
            log.info("evals.%s.%s=%r over eval.%s=%r (set evals.%s.%s to change it)", key, k, item[k], k, shared[k],
                     key, k)
    return methods.merged(shared, item)  # an item's decode keys over the shared ones, key by key


def pilot_conversations(eval_cfg: EvalConfig, prompts_dir: Path) -> list[Any]:
    """The eval.depth=auto pilot's prompts: eval.pilot_prompts dev conversations of each dataset."""
    return [c for name in eval_cfg.datasets
            for c in load_conversations(prompts_dir, name, eval_cfg.pilot_prompts, "dev", test_n=eval_cfg.num_prompts)]


def shape(eval_cfg: EvalConfig, model: Any, proposer: Any, deepest: int, pilot: list[Any], encode: Any,
          stops: set[int]) -> tuple[Any, dict[str, Any] | None]:
    """A draft as eval.depth / eval.width shape it (the run's or a rival's item): capped, or chosen for the machine
    (eval.depth=auto, with what the choice came from), or as the method drafts."""
    auto = auto_depth(eval_cfg, model, proposer, deepest, pilot, encode, stops) if eval_cfg.depth == "auto" else None
    depth, width = (auto["depth"], auto["width"]) if auto else (eval_cfg.depth, eval_cfg.width)
    return (Capped(proposer, depth, width) if depth is not None or width is not None else proposer), auto


def auto_depth(eval_cfg: EvalConfig, model: Any, spec: Any, deepest: int, pilot: list[Any], encode: Any,
               stops: set[int]) -> dict[str, Any]:
    """eval.depth=auto: measured on this machine, on the dev prompts' first turns, before any reported decoding."""
    prompts = [encode([{"role": "user", "content": c.turns[0]}]) for c in pilot]
    auto = choose_depth(model, spec, deepest, prompts, eval_cfg.temperatures, eval_cfg.pilot_tokens, stops,
                        eval_cfg.capacity, eval_cfg.seed)
    log.info("eval.depth=auto (%s): %s (predicted %.2fx over AR; by shape %s) in %.0f s",
             eval_cfg.name or eval_cfg.method,
             auto["choice"],
             auto["predicted"][auto["choice"]]["speedup"],
             ", ".join(f"{d}: {p['speedup']:.2f}x" for d, p in auto["predicted"].items()), auto["seconds"])
    return auto


def summarise(res: Any, method: str, settings: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"method": method, "settings": settings, "results": {}}
    for (ds_name, temp, name), tally in sorted(res.tallies.items()):
        ar = res.tallies[(ds_name, temp, "ar")]
        out["results"].setdefault(ds_name, {}).setdefault(temp, {})[name] = tally.summary(ar)
    for temps in out["results"].values():
        for m in temps.values():
            if "hf_assisted" in m:
                m["spec"]["speedup_vs_hf_assisted"] = round(m["spec"]["tokens_per_s"]
                                                            / m["hf_assisted"]["tokens_per_s"], 4)
            m["spec"]["speedup_vs_hf_generate"] = (round(m["spec"]["tokens_per_s"]
                                                         / m["hf_generate"]["tokens_per_s"], 4)
                                                   if "hf_generate" in m else None)
    return out


def write_outputs(metrics: dict[str, Any], res: Any, method: str, metrics_dir: Path, plots_root: Path) -> None:
    write_record(metrics_dir / f"{method}.json", metrics, headline_of_evaluation(metrics))
    plots = plots_root / method
    with atomic_path(plots, is_dir=True) as tmp:
        with open(tmp / "alpha_by_position.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["setting", "method", "position", "alpha"])
            for ds_name, temps in metrics["results"].items():
                for temp, m in temps.items():
                    for name, s in m.items():
                        for key, v in s.items():
                            if key.startswith("alpha_pos"):
                                w.writerow([f"{ds_name}/{temp}", name, int(key[9:]), v])
        with open(tmp / "speed.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["setting", "method", "tokens_per_s", "speedup", "tau"])
            for ds_name, temps in metrics["results"].items():
                for temp, m in temps.items():
                    for name, s in m.items():
                        w.writerow([f"{ds_name}/{temp}", name, s["tokens_per_s"], s.get("speedup", ""),
                                    s.get("tau", "")])
        with open(tmp / "samples.jsonl", "w") as f:
            for row in res.samples:
                f.write(json.dumps(row) + "\n")


def log_wandb(run: Any, metrics: dict[str, Any]) -> None:
    if not hasattr(run, "id"):
        return
    import wandb

    rivals = rival_names(metrics["settings"])
    run.summary["eval/others_cpu_share"] = metrics["settings"].get("others_cpu_share")  # a busy machine's flag
    for ds_name, temps in metrics["results"].items():
        for temp, m in temps.items():
            for r in (r for r in rivals if r in m):  # each rival's figures under its item's name, beside the run's
                ci = m[r].get("speedup_ci95") or [None, None]
                run.summary.update({f"eval/{ds_name}/{temp}/{r}/tau": m[r].get("tau"),
                                    f"eval/{ds_name}/{temp}/{r}/speedup": m[r].get("speedup"),
                                    f"eval/{ds_name}/{temp}/{r}/speedup_ci95_low": ci[0],
                                    f"eval/{ds_name}/{temp}/{r}/speedup_ci95_high": ci[1]})
            spec = m["spec"]
            prefix = f"eval/{ds_name}/{temp}"
            ci = spec.get("speedup_ci95") or [None, None]
            run.summary.update({f"{prefix}/tau": spec.get("tau"), f"{prefix}/speedup": spec.get("speedup"),
                                f"{prefix}/speedup_ci95_low": ci[0], f"{prefix}/speedup_ci95_high": ci[1],
                                f"{prefix}/tokens_per_s": spec["tokens_per_s"],
                                f"{prefix}/ar_tokens_per_s": m["ar"]["tokens_per_s"]})
            rows = [[int(k[9:]), v] for k, v in spec.items() if k.startswith("alpha_pos")]
            if rows:
                table = wandb.Table(data=rows, columns=["position", "alpha"])
                run.log({f"{prefix}/alpha_by_position":
                         wandb.plot.line(table, "position", "alpha",
                                         title=f"acceptance by position, {ds_name} {temp}")})
