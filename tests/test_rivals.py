"""eval.rivals: EAGLE-3, EAGLE-3.1 and DFlash in one evaluate run (stage compare), on the tiny target.

Each rival drafts as its own evaluate item says, on the run's prompts, interleaved with the method's rows and measured
against the same AR; every row writes the target's greedy text at T = 0; the record, its headline and the report name
each drafter; an item that would measure apart from the run, or a name that clashes, fails before the target loads.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.core.errors import ConfigError
from specdistill.methods.dflash.model import save_dflash
from specdistill.methods.eagle.model import save_eagle

from .helpers.data import save_questions
from .helpers.drafts import random_drafter, random_head
from .helpers.evaluate import eagle_eval_config, greedy_texts

EVALS = {"eagle": {"method": "eagle"},
         "eagle31": {"method": "eagle", "decode": {"path": "models/eagle31"}},
         "dflash": {"method": "dflash"},
         "lookup": {"method": "lookup"},
         "compare": {"method": "eagle", "rivals": ["eagle31", "dflash"]}}


def setting_block(table: str, setting: str) -> list[str]:
    """The drafters' rows of the head-to-head table for one dataset/temperature."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| `") and f", {setting} |" in line) + 2
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


@pytest.fixture
def compare_cfg(tmp_path, tiny_target_dir, monkeypatch) -> dict:
    """The evaluate config of evals.compare over three random drafters saved where the items point."""
    from specdistill.core.models.target import TargetConfig, load_target

    cfg = eagle_eval_config(tmp_path, tiny_target_dir, monkeypatch, name="compare", hf_baselines=False)
    loaded = load_target(TargetConfig(name_or_path=str(tiny_target_dir), dtype="float32"))
    head = random_head(loaded.model, "eagle3.1", torch.arange(100), seed=1)
    head.cfg.target_fingerprint = loaded.fingerprint
    save_eagle(head, tmp_path / "models/eagle31")
    drafter = random_drafter(loaded.model, torch.arange(100))
    drafter.cfg.target_fingerprint = loaded.fingerprint
    save_dflash(drafter, tmp_path / "models/dflash")
    cfg["decode"]["dflash"] = {"path": str(tmp_path / "models/dflash"), "k": 3}
    cfg["eval"]["method"] = "draft"  # the shared section's method: the item's (eagle) wins
    return {**cfg, "evals": {k: dict(v) for k, v in EVALS.items()}}


def test_rivals_run_in_the_same_run_and_every_row_is_the_targets(tmp_path, compare_cfg):
    from specdistill.stages import evaluate as evaluate_stage

    metrics = evaluate_stage.run(compare_cfg)
    rows = metrics["results"]["mtbench"]["T0"]
    assert set(rows) == {"ar", "spec", "eagle31", "dflash"}
    rivals = metrics["settings"]["rivals"]
    assert rivals["eagle31"]["method"] == "eagle" and rivals["eagle31"]["eagle_variant"] == "eagle3.1"
    assert rivals["dflash"]["method"] == "dflash" and rivals["dflash"]["dflash_k"] == 3
    assert metrics["settings"]["eagle_variant"] == "eagle3"  # the run's own method: evals.compare's eagle
    assert 0 <= metrics["settings"]["others_cpu_share"] <= 1  # what else ran on the CPUs while it measured
    for temp in ("T0", "T1"):  # each drafter's own acceptance and timing, against the run's one AR
        for r in ("spec", "eagle31", "dflash"):
            s = metrics["results"]["mtbench"][temp][r]
            assert s["tau"] >= 1 and "alpha_pos1" in s and s["draft_s"] > 0 and s["speedup"] > 0
    t0 = greedy_texts(tmp_path / "plots/compare/samples.jsonl")
    assert all(t0[(turn, r)] == t0[(turn, "ar")] for turn in (1, 2) for r in ("spec", "eagle31", "dflash"))
    head = json.loads((tmp_path / "metrics/compare.json").read_text())  # the run's own draft only: two columns
    spec = [metrics["results"]["mtbench"][t]["spec"] for t in ("T0", "T1")]
    assert head == {"tau_t0": round(spec[0]["tau"], 4),
                    "speedup": round((spec[0]["speedup"] * spec[1]["speedup"]) ** 0.5, 4)}


def test_the_report_sets_the_drafters_side_by_side(tmp_path, compare_cfg):
    from specdistill.reporting.tables import head_to_head, results_table, time_split
    from specdistill.stages import evaluate as evaluate_stage

    metrics = evaluate_stage.run(compare_cfg)
    table = "\n".join(head_to_head({"compare": metrics}))
    assert "## Head to head" in table and "`compare`: the drafters" in table
    for row in ("| eagle (`compare`'s own) | eagle3, dynamic tree 5 nodes",
                "| eagle31 | eagle3.1, dynamic tree 5 nodes", "| dflash | DFlash block of 5, chain K=3"):
        assert table.count(row) == 1, row  # each drafter's draft once, in the legend
    for setting in ("mtbench/T0", "mtbench/T1"):  # then a table per setting, a row per drafter
        block = setting_block(table, setting)
        assert [line.split(" | ")[0] for line in block] == ["| eagle (`compare`'s own)", "| eagle31", "| dflash"]
    details = "\n".join(results_table({"compare": metrics}, "mtbench", "T0"))
    assert "| compare | speculative (dflash) | DFlash block of 5, chain K=3" in details
    assert "| compare | speculative (eagle31) | eagle3.1," in details
    split = "\n".join(time_split({"compare": metrics}))
    assert all(f"| {r} | mtbench/T0 |" in split for r in ("compare", "eagle31", "dflash"))
    assert head_to_head({"eagle": {**metrics, "settings": {**metrics["settings"], "rivals": {}}}}) == []
    # a figure of the drafters' acceptance by position, side by side; none where no run has rivals
    import copy

    from specdistill.reporting import figures

    def counted(n: int) -> dict:  # the run's record with every position reached in n rounds
        out = copy.deepcopy(metrics)
        for temps in out["results"].values():
            for rows in temps.values():
                for s in rows.values():
                    s.update({k: n for k in list(s) if k.startswith("attempts_pos")})
        return out
    assert figures.head_to_head({"compare": counted(100)}, tmp_path / "h2h.png")
    assert (tmp_path / "h2h.png").stat().st_size
    # a position reached in few rounds is left out of it; a record without the counts keeps the tables' four
    few = {"alpha_pos1": 0.5, "attempts_pos1": 40, "alpha_pos2": 1.0, "attempts_pos2": 1}
    assert figures.settled_alphas(few) == [0.5]
    assert figures.settled_alphas({f"alpha_pos{k}": 0.5 for k in range(1, 8)}) == [0.5] * 4
    plain = {**metrics, "settings": {**metrics["settings"], "rivals": {}}}
    assert not figures.head_to_head({"eagle": plain}, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
    # every position from too few rounds (a smoke-sized run): no figure, and the README links none
    assert not figures.head_to_head({"compare": counted(1)}, tmp_path / "few.png")
    assert not (tmp_path / "few.png").exists()
    assert figures.head_to_head_series({"compare": counted(1)}) == []
    # the summary's one row per method draws on the rivals too (cpu_full runs compare alone)
    from specdistill.reporting.summary import summary_table

    rows = [line for line in summary_table({"compare": metrics}) if line.startswith("| ") and "---" not in line][1:]
    assert sorted((r.split(" | ")[0], r.split("(`")[-1].split("`)")[0]) for r in rows) == [
        ("| DFlash", "compare: dflash"), ("| EAGLE-3", "compare"), ("| EAGLE-3.1", "compare: eagle31")]
    same = copy.deepcopy(metrics)  # a rival of the run's own method, faster everywhere: its row replaces the run's
    same["settings"]["rivals"]["eagle31"]["eagle_variant"] = "eagle3"
    for temps in same["results"].values():
        for cell in temps.values():
            cell["eagle31"]["speedup"] = cell["spec"]["speedup"] * 1.5
    rows = [line for line in summary_table({"compare": same}) if line.startswith("| EAGLE-3 |")]
    assert len(rows) == 1 and "(`compare: eagle31`)" in rows[0]
    # the record on disk has sorted keys (dflash before eagle31); the report lists the rivals as eval.rivals does
    from specdistill.core.records import read_record

    written = "\n".join(head_to_head({"compare": read_record(tmp_path / "metrics/compare.json")}))
    assert written.index("| eagle31 | eagle3.1") < written.index("| dflash | DFlash")
    # a share out of few rounds says how few; many rounds, or a record without the counts, the share alone
    from specdistill.reporting.tables import FEW_ROUNDS, alpha_cells

    few = {"alpha_pos1": 0.5, "attempts_pos1": 400, "alpha_pos2": 0.0, "attempts_pos2": 3}
    assert alpha_cells(few) == ["0.50", "0.00 (n=3)"] and FEW_ROUNDS > 3
    assert alpha_cells({"alpha_pos1": 0.5}) == ["0.50"]
    assert "out of n rounds" in table  # this run recorded them; a record from before says it did not
    spec_only = {k: v for k, v in metrics["results"]["mtbench"]["T0"]["spec"].items() if not k.startswith("attempts")}
    old = {**metrics, "results": {"mtbench": {"T0": {**metrics["results"]["mtbench"]["T0"], "spec": spec_only}}}}
    assert "were not recorded in every run here" in "\n".join(head_to_head({"compare": old}))
    spec = metrics["results"]["mtbench"]["T0"]["spec"]
    assert spec["attempts_pos1"] >= 1 and all(f"attempts_pos{k}" in spec for k in range(1, len(alpha_cells(spec)) + 1))
    details = "\n".join(results_table({"compare": read_record(tmp_path / "metrics/compare.json")}, "mtbench", "T0"))
    assert details.index("speculative (eagle31)") < details.index("speculative (dflash)")  # and the details alike


@pytest.mark.parametrize("change,message", [
    ({"rivals": ["nope"]}, r"eval.rivals: 'nope' is no evaluate item"),
    ({"rivals": ["lookup"], "beside": ["lookup"]}, r"\['lookup'\] would share a name"),
    ({"rivals": ["compare"]}, r"\['compare'\] would share a name"),
    ({"rivals": ["eagle31", "eagle31"]}, r"names an item twice"),
    ({"rivals": ["eagle31"], "evals.eagle31": {"method": "eagle", "max_new_tokens": 4}},
     r"evals.eagle31 sets \['max_new_tokens'\] apart from this run's"),
    ({"rivals": ["eagle31"], "evals.eagle31": {"method": "eagle", "branch": "lookup"}},
     r"evals.eagle31 sets \['branch'\], which a rival does not run"),
    ({"rivals": ["eagle31"], "evals.eagle31": {"method": "eagle", "pilot_prompts": 3}},
     r"evals.eagle31 sets \['pilot_prompts'\] apart from this run's"),
    ({"rivals": ["eagle31"], "evals.eagle31": {"method": "nope"}}, r"evals\.eagle31\.method='nope'"),
    ({"rivals": ["eagle31"], "evals.eagle31": {"method": "eagle", "depth": "auto", "width": 2}},  # the item named
     r"evals\.eagle31: eval.depth=auto chooses the width too"),
])
def test_a_rival_that_cannot_share_the_run_fails_before_the_target_loads(compare_cfg, monkeypatch, change, message):
    from specdistill.stages import evaluate as evaluate_stage

    def no_load(*a, **k):
        raise AssertionError("the target loaded before the config was checked")

    monkeypatch.setattr(evaluate_stage, "load_target", no_load)
    evals = {**compare_cfg["evals"], "compare": {"method": "eagle", **{k: v for k, v in change.items()
                                                                       if not k.startswith("evals.")}}}
    evals.update({k[6:]: v for k, v in change.items() if k.startswith("evals.")})
    with pytest.raises(ConfigError, match=message):
        evaluate_stage.run({**compare_cfg, "evals": evals})


def test_wandb_summarises_each_rival_beside_the_run(tmp_path, compare_cfg, monkeypatch):
    from specdistill.core.tracking import wandb_run
    from specdistill.stages import evaluate as evaluate_stage

    monkeypatch.delenv("WANDB_MODE", raising=False)
    metrics = evaluate_stage.run(compare_cfg)
    logger = {"enabled": True, "project": "specdistill-test", "entity": None, "mode": "offline",
              "dir": str(tmp_path), "tags": []}
    with wandb_run(logger, job_type="evaluate", name="evaluate@compare", group="t", config={}) as run:
        evaluate_stage.log_wandb(run, metrics)
        for r in ("dflash", "eagle31"):
            s = metrics["results"]["mtbench"]["T0"][r]
            assert run.summary[f"eval/mtbench/T0/{r}/tau"] == s["tau"]
            assert run.summary[f"eval/mtbench/T0/{r}/speedup"] == s["speedup"]
        assert run.summary["eval/mtbench/T0/tau"] == metrics["results"]["mtbench"]["T0"]["spec"]["tau"]
        assert run.summary["eval/others_cpu_share"] == metrics["settings"]["others_cpu_share"]


def test_a_rival_follows_what_the_run_measures(compare_cfg):
    """A measurement key set on the run's own item (evals.compare) reaches its rivals: it is the run's, not theirs."""
    from specdistill.core.config import section
    from specdistill.stages.evaluate import EvalConfig, eval_item, rival_item

    cfg = {**compare_cfg, "evals": {**compare_cfg["evals"],
                                    "compare": {**compare_cfg["evals"]["compare"], "max_new_tokens": 5,
                                                "temperatures": [0.0]}}}
    eval_cfg = section(EvalConfig, eval_item(cfg), "eval")
    rc, dec = rival_item(cfg, eval_cfg, "dflash")
    assert (rc.max_new_tokens, rc.temperatures, rc.method, dec.k) == (5, [0.0], "dflash", 3)


def test_the_report_reads_records_without_rivals_and_rivals_missing_a_setting(tmp_path, compare_cfg):
    """Records written before eval.rivals have no `rivals`; a rival row missing at one setting is left out there."""
    import copy

    from specdistill.reporting.tables import head_to_head, results_table, time_split
    from specdistill.stages import evaluate as evaluate_stage

    metrics = evaluate_stage.run(compare_cfg)
    old = copy.deepcopy(metrics)
    del old["settings"]["rivals"]
    for temps in old["results"].values():
        for m in temps.values():
            m.pop("eagle31"), m.pop("dflash")
    assert head_to_head({"eagle": old}) == [] and "| eagle | mtbench/T0 |" in "\n".join(time_split({"eagle": old}))
    gap = copy.deepcopy(metrics)
    del gap["results"]["mtbench"]["T1"]["dflash"]
    table = "\n".join(head_to_head({"compare": gap}))
    assert "| dflash | DFlash block of 5, chain K=3 (100 tokens) |" in table  # in the legend
    assert any(r.startswith("| dflash |") for r in setting_block(table, "mtbench/T0"))
    assert not any(r.startswith("| dflash |") for r in setting_block(table, "mtbench/T1"))
    assert "speculative (dflash)" not in "\n".join(results_table({"compare": gap}, "mtbench", "T1"))


def test_a_rival_drafts_in_the_shape_its_item_sets_and_auto_pilots_it_on_the_runs_dev_prompts(tmp_path, compare_cfg):
    """A rival with eval.depth=auto (evaluate@eagle_auto, evaluate@dspark_auto) chooses its shape in the run that
    names it, on the run's dev prompts; one with a fixed depth is capped there; the report shows both."""
    from specdistill.evaluation.autotune import choose
    from specdistill.reporting.tables import auto_depth_table, head_to_head
    from specdistill.stages import evaluate as evaluate_stage

    save_questions(tmp_path / "prompts", ["Write a poem.", "What is Paris?"])  # one test prompt, one dev prompt
    evals = {**compare_cfg["evals"], "eagle_auto": {"method": "eagle", "depth": "auto"},
             "dflash1": {"method": "dflash", "depth": 1},
             "compare": {"method": "eagle", "rivals": ["eagle_auto", "dflash1"], "temperatures": [0.0]}}
    metrics = evaluate_stage.run({**compare_cfg, "eval": {**compare_cfg["eval"], "pilot_tokens": 12},
                                  "evals": evals})
    rivals, rows = metrics["settings"]["rivals"], metrics["results"]["mtbench"]["T0"]
    auto = rivals["eagle_auto"]["auto_depth"]
    assert auto["choice"] == choose(auto["predicted"]) and auto["pilot_prompts"] == 1 and auto["pilot_rounds"] > 0
    assert auto["pilot_tokens"] == 12  # eval.pilot_tokens (smoke runs a short pilot)
    assert all(f"alpha_pos{k}" not in rows["eagle_auto"] for k in range(auto["depth"] + 1, 5))  # capped as chosen
    assert rivals["dflash1"]["depth"] == 1 and "auto_depth" not in rivals["dflash1"]
    assert "alpha_pos1" in rows["dflash1"] and "alpha_pos2" not in rows["dflash1"]  # K=3 capped at one token
    assert "auto_depth" not in metrics["settings"]  # the run's own draft keeps its shape
    t0 = greedy_texts(tmp_path / "plots/compare/samples.jsonl")
    assert t0[(1, "eagle_auto")] == t0[(1, "dflash1")] == t0[(1, "ar")]
    shapes = "\n".join(auto_depth_table({"compare": metrics}))
    assert "| compare: eagle_auto | " in shapes and "compare: dflash1" not in shapes
    assert f"| {auto['choice']} " in shapes
    table = "\n".join(head_to_head({"compare": metrics}))
    assert "| dflash1 | DFlash block of 5, chain K=3, depth 1 " in table and " (auto) " in table  # the legend


def test_each_rival_is_piloted_with_its_own_draft_and_capped_at_its_choice(tmp_path, compare_cfg, monkeypatch):
    """With the choice fixed (depth 1, width 1), what the stage does with it: the pilot gets the rival's own proposer
    and depth, the rival decodes capped at one token, a fixed-shape rival and the run's own draft are not piloted,
    and a run-wide eval.depth shapes the run's draft only."""
    from specdistill.stages import evaluate as evaluate_stage

    save_questions(tmp_path / "prompts", ["Write a poem.", "What is Paris?"])
    calls = []

    def fixed(model, proposer, depth, prompts, *a, **k):
        calls.append((proposer, depth, len(prompts)))
        return {"depth": 1, "width": 1, "choice": "1w1", "predicted": {"1w1": {"speedup": 1.0}}, "seconds": 0.0}

    monkeypatch.setattr(evaluate_stage, "choose_depth", fixed)
    evals = {**compare_cfg["evals"], "eagle_auto": {"method": "eagle", "depth": "auto"},
             "compare": {"method": "eagle", "rivals": ["eagle_auto", "eagle31"], "temperatures": [0.0]}}
    cfg = {**compare_cfg, "evals": evals, "eval": {**compare_cfg["eval"], "depth": 2}}  # a run-wide cap of 2
    metrics = evaluate_stage.run(cfg)
    rows = metrics["results"]["mtbench"]["T0"]
    tree = metrics["settings"]["rivals"]["eagle_auto"]["eagle_tree"]  # the rival's draft reaches its max_depth
    assert len(calls) == 1 and calls[0][1:] == (max(tree["k"], tree["depth"], len(tree["branching"] or [])), 1)
    assert type(calls[0][0]).__name__ != "Capped"  # the pilot drafts uncapped; the cap is its result
    assert "alpha_pos1" in rows["eagle_auto"] and "alpha_pos2" not in rows["eagle_auto"]
    assert metrics["settings"]["rivals"]["eagle31"]["depth"] is None  # eval.depth=2 did not reach the rival
    assert metrics["settings"]["depth"] == 2 and "alpha_pos3" not in rows["spec"]  # but capped the run's own draft
    assert metrics["settings"]["rivals"]["eagle_auto"]["auto_depth"]["choice"] == "1w1"
