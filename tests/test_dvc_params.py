"""dvc.yaml's params are narrow: a change to one method's key reruns that method's stages only (and what
reads their outputs, through deps), and no stage's config hides in its command line."""

from __future__ import annotations

import pytest
import yaml

from .helpers.pipeline import ROOT, items


def stage_params() -> dict[str, list[str]]:
    """`stage@item` -> the params DVC watches for it (as DVC resolves dvc.yaml over params.yaml), and
    `_cmd:<item>` -> its command."""
    out: dict[str, list[str]] = {}
    for name, item in items().items():
        out[name] = list(item.params)
        out["_cmd:" + name] = [item.cmd]
    return out


def rerun_by(changed: str) -> set[str]:
    """The stages whose own params a change to the dotted key `changed` touches."""
    hit = lambda p: changed == p or changed.startswith(p + ".")  # noqa: E731
    return {s for s, ps in stage_params().items() if not s.startswith("_cmd:") and any(hit(p) for p in ps)}


EAGLE_EVALS = {"evaluate@eagle", "evaluate@eagle31", "evaluate@eagle1", "evaluate@eagle_lookup", "evaluate@eagle_auto",
               "evaluate@ref_eagle_matched"}  # speculators' EAGLE-3 head, drafted as ours
EAGLE_REFERENCES = {"reference@eagle_matched", "reference@eagle_shipped"}  # speculators' trainer on eagle's settings


@pytest.mark.parametrize("changed,only", [  # a trained method's evaluate items follow it through its model folder
    ("methods.medusa.num_heads", {"train@medusa"}),
    # the draft's size: not EAGLE's, Medusa's nor the variants'
    ("methods.draft.draft.num_layers", {"train@draft"}),
    ("methods.draft.loss.name", {"train@draft"}),
    ("methods.eagle.optimizer.lr", {"train@eagle"} | EAGLE_REFERENCES),
    ("methods.eagle31.fc_norm", {"train@eagle31"}),
    # how a method drafts (conf/decode/) reruns the evaluate items that draft with it, and no training
    ("decode.suffix.max_spec_tokens", {"evaluate@suffix"}),  # a method that trains nothing
    ("decode.medusa.budget", {"evaluate@medusa"}),
    # online drafts over the same section; compare runs EAGLE-3 and EAGLE-3.1 beside DFlash
    ("decode.eagle.tree.total_tokens", EAGLE_EVALS | {"online@eagle", "compare"}),
    ("decode.dflash.k", {"evaluate@dflash", "evaluate@dspark", "evaluate@dspark_auto", "evaluate@xpress",
                         "evaluate@ref_dflash_matched", "compare"}),  # and a rival
    ("methods.dspark.markov_rank", {"train@dspark"}),
    ("methods.xpress.refiner_rank", {"train@xpress"}),
    ("evals.dspark.decode.path", {"evaluate@dspark", "compare"}),
    ("evals.dspark_auto.depth", {"evaluate@dspark_auto", "compare"}),  # a rival in its chosen shape
    ("evals.eagle31.decode.path", {"evaluate@eagle31", "compare"}),
    ("decode.draft.layers", {"evaluate@draft", "evaluate@untrained", "online@draft"}),
    ("evals.eagle_auto.depth", {"evaluate@eagle_auto", "compare"}),
    ("evals.untrained.k", {"evaluate@untrained"}),
    # a companion's settings: the items that report it beside them or verify it as a branch, and its own
    ("decode.lookup.k", {"evaluate@lookup", "evaluate@draft", "evaluate@untrained", "evaluate@eagle_lookup"}),
])
def test_a_change_to_one_methods_key_reruns_its_stages_only(changed, only):
    assert rerun_by(changed) == only


def test_shared_keys_still_rerun_every_stage_that_reads_them():
    trains = {s for s in stage_params() if s.startswith("train@")}
    assert trains <= rerun_by("distill.data.batch_size") and trains <= rerun_by("trainer.max_steps")
    evaluations = {s for s in stage_params() if s.startswith("evaluate@")} | {"compare"}  # compare: evaluate's too
    assert evaluations == rerun_by("eval.max_new_tokens")


def test_no_stage_command_carries_config():
    """The command names the item (`method=<key>`, `eval.name=<key>`, `<stage>.method=<key>`); every value it
    runs with is in params.yaml, where DVC sees it (an `args:` string was invisible to `dvc params diff`)."""
    for stage, (cmd,) in ((s[5:], c) for s, c in stage_params().items() if s.startswith("_cmd:")):
        words = cmd.split("--config-name params")[-1].split()
        assert len(words) <= 1, (stage, words)
        assert all(w.split("=", 1)[0] in ("method", "eval.name", "online.method", "export.method", "serve.method",
                                          "reference.method") for w in words), (stage, words)


def test_every_item_names_a_config_section():
    from .helpers.config import composed

    cfg = composed()
    for stage in stage_params():
        if stage.startswith("train@"):
            assert stage.split("@")[1] in cfg["methods"], stage
        if stage.startswith("evaluate@"):
            item = cfg["evals"][stage.split("@")[1]]
            assert f"decode.{item['method']}" in stage_params()[stage], stage  # the section its method drafts with
            # and each companion it reports beside or verifies as a branch (its `inputs.companion`)
            for companion in [*item.get("beside", cfg["eval"]["beside"]), item.get("branch", cfg["eval"]["branch"])]:
                assert companion is None or f"decode.{companion}" in stage_params()[stage], (stage, companion)
            # the folder it waits for is the one its draft reads (the item's decode.path, else its method's)
            has_path = "path" in (item.get("decode") or {}) or "path" in (cfg["decode"].get(item["method"]) or {})
            folder = (item.get("decode") or {}).get("path", (cfg["decode"].get(item["method"]) or {}).get("path"))
            if has_path and folder:
                assert item["inputs"]["model"] == folder, (stage, item["inputs"], folder)


def test_the_compare_stage_watches_each_rival_it_runs():
    """stage compare runs the compare section's rivals: each one's item, the decode section its method drafts with
    and its trained folder are in the stage's params and deps (a rival added to compare.rivals must be added there
    too)."""
    from .helpers.config import composed

    cfg = composed()
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["compare"]
    item, params = cfg["compare"], stage_params()["compare"]
    assert "eval.name=compare" in spec["cmd"] and "compare" in params
    assert f"decode.{item['method']}" in params and f"models/{item['method']}" in spec["deps"]
    for rival in item["rivals"]:
        method = cfg["evals"][rival]["method"]
        assert {f"evals.{rival}", f"decode.{method}"} <= set(params), rival
        # the item's folder: evals.<rival>.decode.path, else its method's decode.<method>.path (train@<method>'s)
        folder = (cfg["evals"][rival].get("decode") or {}).get("path") or cfg["decode"][method]["path"]
        assert folder in spec["deps"], rival


def test_every_metrics_and_plots_output_is_under_its_experiment():
    """Experiments never overwrite each other: each stage's metrics and plots outputs (and the report's reads) live
    under metrics/${experiment_name}/ and plots/${experiment_name}/, as paths.metrics_dir / plots_dir say."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    paths = []
    for spec in stages.values():
        body = spec.get("do", spec)
        for key in ("outs", "metrics", "plots", "deps"):
            paths += [p if isinstance(p, str) else next(iter(p)) for p in body.get(key, [])]
    shared = [p for p in paths
              if p.split("/")[0] in ("metrics", "plots") and p.split("/")[1:2] != ["${experiment_name}"]]
    assert not shared, shared
    assert sum(p.startswith("metrics/${experiment_name}") for p in paths) > 10
