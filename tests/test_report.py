"""The report stage renders every metrics file into tables and figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdistill.stages import report

from .helpers.report import metrics


def render(tmp_path, monkeypatch) -> str:
    """The report stage run in `tmp_path` (metrics/, plots/ there); its README text."""
    monkeypatch.chdir(tmp_path)
    report.run({"paths": {}, "logger": {"enabled": False}, "experiment_name": "t"})
    return (tmp_path / "reports/README.md").read_text()


def test_report_writes_tables_figures_and_the_formula_check(tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/draft.json").write_text(json.dumps(metrics("draft", [0.8, 0.5, 0.5, 0.2], 2.1, [1.41, 1.83])))
    # a percentile interval can miss its point estimate (1.6 outside 1.62-1.70): the figure must still draw
    (tmp_path / "metrics/lookup.json").write_text(json.dumps(metrics("lookup", [0.5, 0.5], 1.4, [1.62, 1.70])))
    text = render(tmp_path, monkeypatch)
    assert "| 1.60x (1.41-1.83) |" in text and "| 1.60x (1.62-1.70) |" in text
    assert "| 1.00x |" in text  # AR's own row: 1 by construction, no interval
    assert "## mtbench, temperature 0" in text and "speculative (draft)" in text and "speculative (lookup)" in text
    assert "| 2.10x |" in text  # vs HF assisted
    # eq. 2: chained measured alphas 1 + .8 + .4 + .2 + .04 = 2.44; truncated sum with alpha_pos1 = 1+.8+.64+.512+.4096
    assert "| 2.440 |" in text and "| 3.362 |" in text and "| 5.000 |" in text
    for png in ("acceptance_by_position.png", "speedup.png", "tau_vs_k.png"):
        assert (tmp_path / "reports" / png).read_bytes()[:4] == b"\x89PNG"
    assert "Not comparable" not in text
    assert report.prompt_counts({"mtbench": 4, "humaneval": 5}) == "5 humaneval + 4 mtbench prompts"


def test_report_flags_a_run_on_the_dev_prompts(tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    tuned = metrics("eagle", [0.8, 0.5], 2.1)
    tuned["settings"]["split"] = "dev"
    (tmp_path / "metrics/eagle_dev.json").write_text(json.dumps(tuned))
    (tmp_path / "metrics/lookup.json").write_text(json.dumps(metrics("lookup", [0.5, 0.5], 1.4)))
    text = render(tmp_path, monkeypatch)
    assert "Not comparable: eagle_dev ran on the dev prompts" in text
    assert "some runs predate the stratified order" in text  # lookup.json has no split: written before it
    (tmp_path / "metrics/lookup.json").unlink()
    text = render(tmp_path, monkeypatch)
    assert "Every run here used the dev prompts" in text and "Not comparable" not in text
    assert "(each set's categories in turn)" in text


def test_report_flags_a_run_measured_on_a_busy_machine(tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    busy, quiet = metrics("eagle", [0.8, 0.5], 2.1), metrics("lookup", [0.5, 0.5], 1.4)
    busy["settings"]["others_cpu_share"], quiet["settings"]["others_cpu_share"] = 0.46, 0.02
    (tmp_path / "metrics/eagle.json").write_text(json.dumps(busy))
    (tmp_path / "metrics/lookup.json").write_text(json.dumps(quiet))
    text = render(tmp_path, monkeypatch)
    assert "**Measured on a busy machine: eagle (46%) of the CPUs" in text and "lookup (2%)" not in text
    assert "is recorded for" not in text  # every run measured it
    busy["settings"].pop("others_cpu_share")  # a record from before the share was measured: no flag, but counted
    (tmp_path / "metrics/eagle.json").write_text(json.dumps(busy))
    text = render(tmp_path, monkeypatch)
    assert "busy machine" not in text and "is recorded for 1 of 2 runs" in text


def test_report_without_metrics_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="run the evaluate stages first"):
        report.run({"paths": {}, "logger": {"enabled": False}})


def train_metrics(loss: str, source: str, alpha: float, layers: int = 1) -> dict:
    return {"method": "draft", "steps": 160, "final": {"val/alpha": alpha, "val/alpha_t0": alpha - 0.1,
                                                       "val/tau_sim": 1 + alpha, "val/tau_sim_t0": 1.5},
            "settings": {"draft": {"name": "xs", "num_layers": layers}, "method": {"init": "from_target"},
                         "draft_vocab": 8192, "loss": {"name": loss}, "distill": {"data": {"source": source}},
                         "train_tokens": 57028, "draft_parameters": 35_400_000}}


def test_report_has_the_distillation_tables_and_curves(tmp_path, monkeypatch):
    (tmp_path / "metrics/sweep").mkdir(parents=True)
    (tmp_path / "metrics/draft.json").write_text(json.dumps(metrics("draft", [0.8, 0.5], 2.1)))
    (tmp_path / "metrics/train_draft.json").write_text(json.dumps(train_metrics("fkl", "target", 0.612)))
    (tmp_path / "metrics/train_draft_ce.json").write_text(json.dumps(train_metrics("ce", "dataset", 0.431)))
    (tmp_path / "metrics/sweep/draft-s-tvd.json").write_text(json.dumps(train_metrics("tvd", "target", 0.655, 2)))
    (tmp_path / "plots/train_draft").mkdir(parents=True)
    (tmp_path / "plots/train_draft/val.csv").write_text("step,alpha,alpha_t0,tau_sim,tau_sim_t0\n40,0.3,0.2,1.4,1.2\n"
                                                        "80,0.5,0.4,1.8,1.5\n")
    text = render(tmp_path, monkeypatch)
    assert "| draft | xs (1 layer) | from_target | 8192 | fkl | target | 160 | 57,028 | 0.612 |" in text
    assert "| draft_ce | xs (1 layer) | from_target | 8192 | ce | dataset |" in text
    assert "### Sweep" in text and "| draft-s-tvd | xs (2 layers) |" in text
    assert (tmp_path / "reports/alpha_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "train_draft" not in [k for k in report.load_metrics(tmp_path / "metrics")]
    # the generate stage's timing sits beside the evaluations and is not one
    (tmp_path / "metrics/generate.json").write_text(json.dumps({"generation": {"tokens_per_s": 270.7}, "shards": {}}))
    assert list(report.load_metrics(tmp_path / "metrics")) == ["draft"]
    assert "| generate |" not in render(tmp_path, monkeypatch)


def test_report_has_the_medusa_and_eagle_tables(tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/draft.json").write_text(json.dumps(metrics("draft", [0.8, 0.5], 2.1)))
    (tmp_path / "metrics/train_draft.json").write_text(json.dumps(train_metrics("fkl", "target", 0.612)))
    acc = [[0.6, 0.1, 0.05], [0.4, 0.1, 0.05], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]]
    medusa = train_metrics("fkl", "target", 0.5)
    medusa["settings"]["method"] = {"name": "medusa", "num_heads": 4, "num_layers": 1}
    medusa["settings"]["draft_parameters"] = 20_000_000
    medusa["final"].update({f"val/head{k}_{m}": 0.1 * k for k in range(1, 5) for m in ("top1", "top5", "alpha")})
    medusa["trees"] = {"acc": acc, "trees": {"4": {"choices": [[0], [1], [0, 0], [0, 0, 0]], "expected_tau": 2.07}}}
    (tmp_path / "metrics/train_medusa.json").write_text(json.dumps(medusa))
    eagle = train_metrics("fkl", "target", 0.7)
    eagle["settings"]["method"] = {"name": "eagle", "variant": "eagle3", "ttt_steps": 3,
                                   "init_from": "/elsewhere/models/eagle_a"}  # recorded before lineage: named only
    eagle["final"].update({f"val/alpha_pos{k}{t}": 0.5 for k in range(1, 5) for t in ("", "_t0")})
    eagle["final"]["val/vocab_coverage"] = 0.883
    (tmp_path / "metrics/train_eagle.json").write_text(json.dumps(eagle))
    (tmp_path / "metrics/train_eagle_check.json").write_text(json.dumps({**eagle, "steps": 0}))  # max_steps=0
    code = {**eagle, "settings": {**eagle["settings"], "prompt_mix": {"code_fraction": 0.5},
                                  "lineage": [{"run": "eagle", "steps": 2400}, {"run": "eagle_cont", "steps": 1200}]}}
    (tmp_path / "metrics/train_eagle_code.json").write_text(json.dumps(code))  # data.code_fraction=0.5
    union = metrics("eagle", [0.5, 0.4], 2.5)
    union["settings"].update(eagle_variant="eagle3", draft_vocab=8192, lookup_branch=True, lookup_k=8,
                             eagle_tree={"shape": "dynamic", "total_tokens": 8})
    (tmp_path / "metrics/eagle_lookup.json").write_text(json.dumps(union))
    text = render(tmp_path, monkeypatch)
    assert "eagle3, dynamic tree 8 nodes + prompt lookup, K=8 (8192 tokens)" in text
    assert "| medusa | Medusa, 4 heads x 1 block |" in text and "| 1 | x(t+2) | 0.100 | 0.100 | 0.100 |" in text
    # exercise 3 from the measured accuracies: the cartesian 3x3x3 tree (39 tokens) against the 4-node tree
    assert "27 candidate sequences and 39 tree tokens" in text and "the chosen tree spends 4 tokens" in text
    assert "| Medusa heads | 20.0M | 38 MiB |" in text and "| separate draft `draft` | 35.4M |" in text
    assert "| eagle | EAGLE head (eagle3, 1 layer, TTT 3) | continued from `eagle_a` |" in text and "| 0.883 |" in text
    assert "| medusa | Medusa, 4 heads x 1 block | target's LM head |" in text  # no init_from: how it started
    assert "| eagle_check | EAGLE head (eagle3, 1 layer, TTT 3) | validated as saved in `eagle_a` |" in text
    assert "| eagle_code | EAGLE head (eagle3, 1 layer, TTT 3) | continued from `eagle_cont` (eagle 2400 + " \
           "eagle_cont 1200 steps) |" in text and "/elsewhere" not in text
    assert "| fkl | target, 50% code prompts | 160 |" in text and "| fkl | target | 160 |" in text


def test_report_has_the_online_table_and_curve(tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/draft.json").write_text(json.dumps(metrics("draft", [0.8, 0.5], 2.1)))
    part = lambda f, o: {"frozen": {"requests": 2, "acceptance_rate": f, "tau": 1.2},  # noqa: E731
                         "online": {"requests": 2, "acceptance_rate": o, "tau": 1.4}, "gain": round(o - f, 4)}
    online = {"method": "draft", "scenario": "code", "stream": part(0.2, 0.25), "held_out": part(0.21, 0.33),
              "updates": [{"request": 2}], "stopped_at": None, "settings": {"window": 2},
              "time": {"serve_s": 10.0, "update_s": 1.0, "update_share": 0.0909}}
    (tmp_path / "metrics/online_draft.json").write_text(json.dumps(online))
    (tmp_path / "plots/online_draft").mkdir(parents=True)
    (tmp_path / "plots/online_draft/curve.csv").write_text(
        "request,frozen,online,frozen_window,online_window,version\n0,0.2,0.2,0.2,0.2,0\n1,0.2,0.3,0.2,0.25,1\n"
        "2,0.21,0.33,0.205,0.315,1\n3,0.21,0.33,0.21,0.33,1\n")
    text = render(tmp_path, monkeypatch)
    assert "| online_draft | code | held out | 2 | 0.210 | 0.330 | +0.120 | 1.20 | 1.40 |" in text
    assert "| online_draft | 1 | – | – | 1.0 | 10.0 | 9.1% |" in text  # no gate: nothing to roll back
    assert (tmp_path / "reports/online_curves.png").read_bytes()[:4] == b"\x89PNG"
    online.update(updates=[{"request": 2, "deployed": True}, {"request": 4, "deployed": False}],
                  settings={"window": 2, "gate": 2})
    (tmp_path / "metrics/online_draft.json").write_text(json.dumps(online))
    assert "| online_draft | 2 | 1 | – | 1.0 | 10.0 | 9.1% |" in render(tmp_path, monkeypatch)
    assert "### Inside the engine" not in render(tmp_path, monkeypatch)
    # online_engine@draft: the engine's run of the same stream, beside our decoder's
    engine = {**online, "held_out": part(0.21, 0.36), "settings": {"window": 2},
              "engine": {"versions_loaded": 2, "load_s": 0.03, "tokens_per_s_outside": 40.5,
                         "tokens_per_s_during_updates": 30.1, "identical_to_frozen": {"requests": 4, "identical": 4}}}
    (tmp_path / "metrics/online_engine_draft.json").write_text(json.dumps(engine))
    text = render(tmp_path, monkeypatch)
    assert "| online_engine_draft | +0.150 | +0.120 | 2 | 15 | 40.5 | 30.1 | 4/4 |" in text


def test_draft_label_names_a_lookup_branch_for_every_method_and_the_key_it_had_before():
    from specdistill.reporting.tables import draft_label
    eagle = {"method": "eagle", "settings": {"eagle_variant": "eagle3", "draft_vocab": 8192, "lookup_k": 8,
                                             "eagle_tree": {"shape": "dynamic", "total_tokens": 8}}}
    assert draft_label(eagle)[0] == "eagle3, dynamic tree 8 nodes (8192 tokens)"
    old = {**eagle, "settings": {**eagle["settings"], "eagle_lookup": True}}  # metrics written before the rename
    assert draft_label(old)[0] == "eagle3, dynamic tree 8 nodes + prompt lookup, K=8 (8192 tokens)"
    medusa = {"method": "medusa", "settings": {"medusa_heads": 4, "tree_nodes": 16, "draft_vocab": 8192,
                                               "lookup_branch": True, "lookup_k": 6}}
    assert draft_label(medusa)[0] == "Medusa 4 heads, 16-node tree + prompt lookup, K=6 (8192 tokens)"
    untrained = {"method": "draft", "settings": {"draft": "target's first 4 layers",
                                                 "lookup_branch": True, "lookup_k": 8}}
    assert draft_label(untrained) == ("target's first 4 layers + prompt lookup, K=8", "untrained")
    tree = {**untrained, "settings": {**untrained["settings"], "lookup_branches": 2}}  # eval.lookup_branches=2
    assert draft_label(tree) == ("target's first 4 layers + prompt lookup, a tree of 2 chains, K=8", "untrained")
    assert draft_label({"method": "lookup",
                        "settings": {"lookup_branches": 2}})[0] == "prompt lookup, a tree of 2 chains"
    assert draft_label({"method": "lookup", "settings": {}})[0] == "prompt lookup"
    dflash = {"method": "dflash", "settings": {"block_size": 8, "dflash_k": 7, "draft_vocab": 8192,
                                               "draft_training": {"loss": "fkl", "data": "target"}}}
    assert draft_label(dflash) == ("DFlash block of 8, chain K=7 (8192 tokens)", "fkl on target")


def test_a_continued_runs_curve_is_labelled_with_what_came_before():
    from specdistill.reporting.training import curve_label

    lineage = [{"run": "a", "steps": 2400}, {"run": "check", "steps": 0}, {"run": "b", "steps": 1200}, {"run": "bare"}]
    method = {"init_from": "models/b"}
    assert curve_label("scratch", {"settings": {"method": {}}}) == "scratch"
    assert curve_label("old", {"settings": {"method": method}}) == "old (continued)"  # recorded before lineage
    assert curve_label("c", {"settings": {"method": method, "lineage": lineage}}) == "c (after 3600 steps)"


def test_report_names_the_cpu_kind_and_flags_runs_from_different_machines(tmp_path, monkeypatch):
    """On a CPU the kind sets a speed-up's size (AVX2 emulates bf16: verification costs several steps more),
    so the header names it and runs measured on different kinds are flagged."""
    (tmp_path / "metrics").mkdir()
    amx = metrics("eagle", [0.8, 0.5], 2.1)
    amx["settings"].update(device="Intel Xeon", cpu={"capability": "AVX512", "native_bf16": True})
    (tmp_path / "metrics/eagle.json").write_text(json.dumps(amx))
    text = render(tmp_path, monkeypatch)
    assert "Every record here: on Intel Xeon (AVX512, bf16 native)." in text and "more than one machine" not in text
    assert text.count("Intel Xeon") == 1  # named once, in the provenance line
    avx2 = metrics("lookup", [0.5, 0.5], 1.4)
    avx2["settings"].update(device="AMD EPYC", cpu={"capability": "AVX2", "native_bf16": False})
    (tmp_path / "metrics/lookup.json").write_text(json.dumps(avx2))
    text = render(tmp_path, monkeypatch)
    assert "Measured on more than one machine (AMD EPYC (AVX2, bf16 emulated); " \
           "Intel Xeon (AVX512, bf16 native))" in text


def test_report_names_one_code_version_or_says_which_differ(tmp_path, monkeypatch):
    """Every record names the code it ran (settings.code, written by write_record); the report names the one
    version behind all its records (evaluate, train, serve, online, reference alike) or flags a mix, as it flags a
    mix of machines."""
    (tmp_path / "metrics").mkdir()
    run = metrics("eagle", [0.8, 0.5], 2.1)
    run["settings"].update(device="AMD EPYC", cpu={"capability": "AVX512", "native_bf16": True}, code="1f3676a0c0de")
    (tmp_path / "metrics/eagle.json").write_text(json.dumps(run))
    text = render(tmp_path, monkeypatch)
    assert "Every record here: code 1f3676a0c0de, on AMD EPYC (AVX512, bf16 native)." in text
    assert "more than one code version" not in text
    train = train_metrics("fkl", "target", 0.612)  # a train record of other code: the mix is named
    train["settings"]["code"] = "5120ed2c0de0+changes"
    (tmp_path / "metrics/train_draft.json").write_text(json.dumps(train))
    text = render(tmp_path, monkeypatch)
    assert "**Measured by more than one code version** (1f3676a0c0de, 5120ed2c0de0+changes)" in text
    assert "Every record here: code" not in text


def test_the_code_version_is_the_last_code_commit_and_names_uncommitted_changes(tmp_path, monkeypatch):
    import subprocess

    from specdistill.core.records import commit_of

    assert commit_of(tmp_path) is None  # not the project's checkout (an installed package): nothing to name
    (tmp_path / "src/specdistill").mkdir(parents=True)
    (tmp_path / "src/specdistill/a.py").write_text("x = 1\n")
    assert commit_of(tmp_path) is None  # no git repository
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]

    def commit() -> str:
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", "c", "--no-verify"], check=True)
        return subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()

    subprocess.run([*git, "init", "-q"], check=True)
    code = commit()
    assert commit_of(tmp_path) == code
    (tmp_path / "metrics").mkdir()  # what a run writes is not code, nor is a commit of docs or results
    (tmp_path / "metrics/m.json").write_text("{}")
    assert commit_of(tmp_path) == code
    (tmp_path / "README.md").write_text("docs")
    commit()
    assert commit_of(tmp_path) == code
    (tmp_path / "src/specdistill/a.py").write_text("x = 2\n")  # two different edits: two versions
    first = commit_of(tmp_path)
    (tmp_path / "src/specdistill/a.py").write_text("x = 3\n")
    second = commit_of(tmp_path)
    assert first.startswith(code + "+changes.") and second.startswith(code + "+changes.") and first != second
    (tmp_path / "src/specdistill/a.py").write_text("x = 1\n")
    (tmp_path / "src/specdistill/new.py").write_text("y = 1\n")  # a new file of code is a change too
    assert commit_of(tmp_path).startswith(code + "+changes.")
    assert commit_of(tmp_path / "src") is None  # a folder inside a checkout is not a checkout of its own
    # a new file removed between git's listing and the read (an editor's temporary file) is no change and no crash
    real_read = Path.read_bytes

    def vanishing(self):
        if self.name == "new.py":
            raise FileNotFoundError(self)
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", vanishing)
    assert commit_of(tmp_path) == code


def test_a_record_names_its_code_and_the_report_flags_records_naming_none(tmp_path, monkeypatch):
    from specdistill.core import records
    from specdistill.core.records import read_record, write_record

    monkeypatch.setattr(records, "code_version", lambda: "abc+changes.1234")
    write_record(tmp_path / "x.json", {"settings": {"method": "m"}, "results": {}}, {"tau": 1})
    assert read_record(tmp_path / "x.json")["settings"] == {"method": "m", "code": "abc+changes.1234"}
    assert json.loads((tmp_path / "x.json").read_text()) == {"tau": 1}  # the headline: no code column
    assert report.provenance([{"settings": {"code": "abc"}}, {"settings": {}}, {}]) == [
        "**Measured by more than one code version** (abc, 2 records naming none): `dvc repro` reruns only the items "
        "whose own code changed, so the figures of one version need `dvc repro -f`.", ""]
    assert report.provenance([{"settings": {}}]) == []  # all from before the code was recorded: as they rendered


def test_environment_names_the_cpu_and_its_kind(monkeypatch):
    from pathlib import Path

    from specdistill.core import hardware

    real_read = Path.read_text
    flags = {"flags": "fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile"}

    def cpuinfo(self, *a, **k):
        if str(self) != "/proc/cpuinfo":
            return real_read(self, *a, **k)
        return f"processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: {flags['flags']}\n"

    monkeypatch.setattr(Path, "read_text", cpuinfo)
    monkeypatch.setattr(hardware.torch.cuda, "is_available", lambda: False)
    env = hardware.environment()
    assert env["device"] == "Test CPU 9000" and set(env["cpu"]) == {"capability", "native_bf16", "matrix_units"}
    assert env["cpu"]["matrix_units"] == "AMX"  # torch's capability calls AMX and AVX512-BF16 both "AVX512"
    flags["flags"] = "fpu avx2 avx512f avx512_bf16"
    assert hardware.matrix_units() == "AVX512-BF16"
    flags["flags"] = "fpu avx2"
    assert hardware.matrix_units() is None


def test_the_summary_keeps_the_best_setting_of_each_method_and_the_engines_deployed_speedup(tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    slow, fast = metrics("eagle", [0.5, 0.4], 1.7), metrics("eagle", [0.6, 0.5], 2.0)
    fast["results"]["mtbench"]["T0"]["spec"]["speedup"] = 1.9  # eagle_k4 beats eagle (1.6): the row keeps eagle_k4
    for m in (slow, fast):
        m["settings"].update(eagle_variant="eagle3", draft_vocab=8192, eagle_tree={"shape": "chain", "k": 2})
    union = metrics("eagle", [0.5, 0.4], 2.5)
    union["settings"].update(eagle_variant="eagle3", lookup_branch=True, lookup_k=8,
                             eagle_tree={"shape": "chain", "k": 2})
    for name, m in {"eagle": slow, "eagle_k4": fast, "eagle_lookup": union,
                    "lookup": metrics("lookup", [0.5, 0.5], 1.4)}.items():
        (tmp_path / f"metrics/{name}.json").write_text(json.dumps(m))
    cell = {"tau": 1.3, "alpha_pos1": 0.3, "speedup": 1.0, "tokens_per_s": 30.0, "latency_p50_s": 1.0}
    ar = {"tokens_per_s": 30.0, "latency_p50_s": 1.0}
    serve = {"settings": {"k": [1, 3]}, "results": {"mtbench": {"T0.0": {c: {"ar": ar, "k1": cell, "k3": cell}
                                                                         for c in ("c1", "c16")}}},
             "chosen_k": {"c1": {"k": 1, "speedup_geomean": 1.12},
                                                                  "c16": {"k": 3, "speedup_geomean": 0.91}},
             "deploy": {"speedup_geomean": {"c1": 1.10}}}
    serve["settings"]["others_cpu_share"] = 0.3  # the engine measured beside other work
    (tmp_path / "metrics/serve_eagle.json").write_text(json.dumps(serve))
    text = render(tmp_path, monkeypatch)
    # flagged where its speed-up is first shown, with the evaluate runs, once
    assert text.count("**Measured on a busy machine: serve@eagle (30%)") == 1
    assert text.index("busy machine") < text.index("## Every run")
    summary = text[text.index("## Summary"):text.index("## Every run")]
    ours = summary[:summary.index("In the engine")]
    rows = [line for line in ours.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # one row per method, best geomean first; the union is its own method; the slower EAGLE-3 setting is not shown
    assert [r.split(" | ")[0] for r in rows] == ["| EAGLE-3", "| EAGLE-3 + prompt lookup branch", "| prompt lookup"]
    assert "(`eagle_k4`)" in rows[0] and "tau 2.00, 1.90x" in rows[0] and "`eagle`)" not in summary
    # the engine: the deployed schedule's speed-up where one was served, else the best K's
    assert "| eagle | 1.10x deployed | 0.91x at K=3 (none deployed) |" in summary
    assert "### mtbench, temperature 0" in text  # every run stays in the detail tables


def test_each_figure_has_a_panel_per_dataset_and_temperature(tmp_path, monkeypatch):
    from specdistill.reporting import figures

    (tmp_path / "metrics").mkdir()
    m = metrics("draft", [0.8, 0.5], 2.1)
    m["results"]["humaneval"] = {"T1": m["results"]["mtbench"]["T0"]}  # 2 datasets x 2 temperatures, one absent
    (tmp_path / "metrics/draft.json").write_text(json.dumps(m))
    saved = []
    monkeypatch.setattr(figures, "legend_beside", lambda fig, axes, out, title: saved.append(
        (out.name, sorted(k for k, ax in axes.items() if ax.get_visible()), [len(ax.lines) for ax in axes.values()])))
    render(tmp_path, monkeypatch)
    panels = [("humaneval", "T1"), ("mtbench", "T0")]
    assert {name: p for name, p, _ in saved} == {"acceptance_by_position.png": panels, "speedup.png": panels,
                                                 "tau_vs_k.png": panels}
    lines = {name: n for name, _, n in saved}
    # humaneval T0, T1, mtbench T0, T1: a series where measured
    assert lines["acceptance_by_position.png"] == [0, 1, 1, 0]


def test_the_engine_section_gives_each_runs_step_cost_and_the_deployed_schedule(tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/draft.json").write_text(json.dumps(metrics("draft", [0.8, 0.5], 2.1)))
    cell = lambda tau, speedup: {"tau": tau, "alpha_pos1": 0.3, "speedup": speedup,  # noqa: E731
                                 "tokens_per_s": 30.0 * speedup, "latency_p50_s": 1.0}
    ar = {"tokens_per_s": 30.0, "latency_p50_s": 1.2}
    serve = {"settings": {"k": [1, 3], "vllm": "0.32.0"},
             "results": {"humaneval": {"T0.0": {"c1": {"ar": ar, "k1": cell(1.35, 1.08), "k3": cell(1.45, 0.90)},
                                                "c16": {"ar": ar, "k1": cell(1.35, 0.50), "k3": cell(1.45, 0.40)}}}},
             "chosen_k": {"c1": {"k": 1, "speedup_geomean": 1.08}, "c16": {"k": 1, "speedup_geomean": 0.50}},
             "deploy": {"speedup_geomean": {"c1": 1.05, "c16": 0.62}, "speculative_config": {"method": "eagle3"}},
             "cold_start_s": {"k1": 20.0}}
    (tmp_path / "metrics/serve_eagle.json").write_text(json.dumps(serve))
    text = render(tmp_path, monkeypatch)
    engine = text[text.index("## In the engine"):]
    assert "| eagle | 1 | 1 | 1.08x | 1.05x | 1.08x | 0.90x |" in engine  # K chosen at c1, deployed, each K
    assert "| eagle | 16 | off (best K=1: 0.50x) | 1.00x | 0.62x | 0.50x | 0.40x |" in engine
    # the step cost is tau / speed-up: 1.35 / 1.08 = 1.25 plain steps at c1, 1.35 / 0.50 = 2.70 at c16
    assert "| 1.08x | 1.25 |" in engine and "| 0.50x | 2.70 |" in engine
    assert "| eagle | 1.05x deployed | 0.62x deployed |" in text[:text.index("## Every run")]  # the summary's row


def test_an_auto_depth_run_shows_its_prediction_beside_the_measurement(tmp_path, monkeypatch):
    (tmp_path / "metrics").mkdir()
    m = metrics("eagle", [0.5, 0.4], 1.7)
    m["settings"]["auto_depth"] = {"depth": 2, "pilot_rounds": 40, "seconds": 12.0, "predicted": {
        "0": {"speedup": 1.0}, "1": {"speedup": 1.21}, "2": {"speedup": 1.34}}}
    (tmp_path / "metrics/eagle_auto.json").write_text(json.dumps(m))
    text = render(tmp_path, monkeypatch)
    assert "| eagle_auto | 0: 1.00x / 1: 1.21x / 2: 1.34x | 2 | 1.34x | mtbench/T0: 1.60x | 40 rounds, 12 s |" in text


def test_an_auto_run_that_chose_a_width_names_the_shape(tmp_path, monkeypatch):
    from specdistill.reporting.tables import depth_cap

    (tmp_path / "metrics").mkdir()
    m = metrics("eagle", [0.5, 0.4], 1.7)
    m["settings"]["auto_depth"] = {"depth": 2, "width": 1, "choice": "2w1", "pilot_rounds": 40, "seconds": 12.0,
                                   "predicted": {"0": {"speedup": 1.0}, "2w1": {"speedup": 1.12},
                                                 "2": {"speedup": 0.81}}}
    (tmp_path / "metrics/eagle_auto.json").write_text(json.dumps(m))
    text = render(tmp_path, monkeypatch)
    row = "| eagle_auto | 0: 1.00x / 2w1: 1.12x / 2: 0.81x | 2w1 | 1.12x | mtbench/T0: 1.60x | 40 rounds, 12 s |"
    assert row in text
    assert depth_cap(m["settings"]) == ", depth 2, width 1 (auto)"
    assert depth_cap({"depth": None, "width": 1}) == ", width 1" and depth_cap({"depth": 3}) == ", depth 3"


def test_each_method_describes_itself_and_eagle31_is_a_family_of_its_own():
    """The report's names come from the methods (`Method.describe`): EAGLE-3.1 is not folded into EAGLE-3's row."""
    from specdistill.methods import describe_training
    from specdistill.reporting.summary import family

    tree = {"shape": "dynamic", "total_tokens": 8}
    assert family({"method": "eagle", "settings": {"eagle_variant": "eagle3.1", "eagle_tree": tree}}) == "EAGLE-3.1"
    assert family({"method": "eagle", "settings": {"eagle_variant": "eagle3", "eagle_tree": tree,
                                                   "lookup_branch": True}}) == "EAGLE-3 + prompt lookup branch"
    assert family({"method": "draft", "settings": {}}) == "separate draft (untrained)"
    head = {"name": "eagle", "variant": "eagle3", "fc_norm": True, "norm_output": True, "ttt_steps": 3}
    assert describe_training({"method": head})[0] == "EAGLE head (eagle3.1, 1 layer, TTT 3)"
    assert describe_training({"method": {"name": "medusa", "num_heads": 4, "num_layers": 1}}) == (
        "Medusa, 4 heads x 1 block", "target's LM head")


def test_the_reference_section_pools_the_engines_counts_and_sets_each_trainer_beside_ours():
    from specdistill.reporting.reference import engine_pooled, reference_tables

    def served(first: list[int], drafts: int) -> dict:
        rows = {ds: {"T0.0": {"c1": {"k2": {"drafts": drafts, "accepted_per_pos": first, "tau": 0.0}}}}
                for ds in ("humaneval", "mtbench")}
        return {"settings": {"agreement_k": 2, "concurrency": [1, 4]}, "results": rows}

    ours, ref = served([40, 10], 100), served([60, 30], 100)
    pooled = engine_pooled(ref, "T0.0")  # summed over both datasets, then divided
    assert pooled["drafts"] == 200 and pooled["accepted_per_pos"] == [120, 60]
    assert pooled["alpha_pos1"] == 0.6 and pooled["alpha_pos2"] == 0.5 and pooled["tau"] == 1 + 180 / 200
    record = {"recipe": "matched", "run": {"steps": 4, "tokens": 900, "train_s": 2.0, "tokens_per_s": 450.0,
                                           "peak_rss_mib": 900.0},
              "settings": {"methods_key": "eagle", "speculators": "0.9.0", "engine_torch": "2.x"}}
    runs = {"eagle": {"run": {"steps": 4, "tokens": 1000, "train_s": 4.0, "tokens_per_s": 250.0,
                              "peak_rss_mib": 1500.0}}}
    lines = reference_tables({"eagle_matched": record}, runs, {}, {"eagle": ours, "ref_eagle_matched": ref})
    text = "\n".join(lines)
    assert "| eagle | ours | 4 | 1000 | 4.0 | 250 | 1500 |" in text
    assert "| eagle | speculators, matched | 4 | 900 | 2.0 | 450 | 900 |" in text
    row = next(line for line in lines if line.startswith("| eagle | speculators, matched | 0.60"))
    assert "| 1.90 |" in row and "| 4.00 |" in row  # its tau; z = (0.6 - 0.4) / sqrt(0.5 * 0.5 * 2 / 200)
    assert reference_tables({}, runs, {}, {}) == []


def test_the_data_curve_fits_tau_against_the_training_tokens_per_trainer():
    """Drafts that differ only in train_fraction form one curve per trainer; tau = a + b ln(tokens) is fitted over
    them and the tokens for tau 2.5 and 3 read off it. Drafts of another architecture stay out of it."""
    import math

    from specdistill.reporting.reference import data_curve, engine_pooled, log_fit, tokens_for

    def served(tau: float) -> dict:  # one dataset, K = 1: tau = 1 + accepted / drafts
        acc = round((tau - 1) * 1000)
        return {"settings": {"agreement_k": 1, "concurrency": [1]},
                "results": {"humaneval": {"T0.0": {"c1": {"k1": {"drafts": 1000, "accepted_per_pos": [acc]}}}}}}

    def run(fraction: float, tokens: int, variant: str = "eagle3", logged: int = 10) -> dict:
        return {"settings": {"method": {"name": "eagle", "variant": variant}, "draft": None, "loss": "fkl",
                             "trainer": {"max_steps": 8, "log_every_n_steps": logged}, "target_fingerprint": "t",
                             "val_tokens": 900, "distill": {"data": {"train_fraction": fraction, "batch_size": 8}},
                             "train_tokens": tokens}}

    a, b = 0.5, 0.1  # ours: tau = 0.5 + 0.1 ln(tokens) exactly at 1e4, 2e4, 4e4
    runs = {"eagle_d25": run(0.25, 10_000), "eagle_d50": run(0.5, 20_000, logged=1), "eagle": run(1.0, 40_000),
            "eagle31": run(1.0, 40_000, variant="eagle3.1")}
    serve = {k: served(a + b * math.log(n)) for k, n in
             (("eagle_d25", 10_000), ("eagle_d50", 20_000), ("eagle", 40_000))}
    serve["eagle31"] = served(1.9)
    reference = {f"{k}_matched": {"recipe": "matched", "settings": {"methods_key": k}} for k in ("eagle_d25", "eagle")}
    serve |= {"ref_eagle_d25_matched": served(1.40), "ref_eagle_matched": served(1.60)}
    lines = data_curve(reference, runs, serve)
    assert lines[0].startswith("## How much data: eagle and its smaller sizes")
    ours = next(line for line in lines if line.startswith("| ours |"))
    assert log_fit([(1e4, a + b * math.log(1e4)), (4e4, a + b * math.log(4e4))]) == pytest.approx((a, b))
    fit = log_fit([(n, engine_pooled(serve[k], "T0.0")["tau"]) for k, n in
                   (("eagle_d25", 1e4), ("eagle_d50", 2e4), ("eagle", 4e4))])  # the served taus, to 1/1000
    assert f"| {a:.2f} | {b:.3f} | {tokens_for(fit, 2.5):,.0f} | {tokens_for(fit, 3.0):,.0f} |" in ours
    assert "(eagle_d25)" in ours and "(eagle31)" not in "\n".join(lines)  # EAGLE-3.1 is not a size of EAGLE-3
    ref = next(line for line in lines if line.startswith("| speculators, matched |"))
    assert "1.40 at 10,000 (ref_eagle_d25_matched), 1.60 at 40,000 (ref_eagle_matched)" in ref
    assert tokens_for((1.0, -0.1), 2.5) is None and log_fit([(1e4, 1.5)]) is None
    assert data_curve(reference, {"eagle": runs["eagle"]}, serve) == []  # one size: no curve
    assert tokens_for((1.5, 1e-3), 3.0) is None  # flat: e^1500 tokens is no prediction (and no OverflowError)
    assert any(line.startswith("| ours |") for line in data_curve({}, runs, serve))  # ours alone is a curve
