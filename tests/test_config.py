"""Config composition: every experiment composes, unknown keys fail at start with the key named."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from hydra.errors import ConfigCompositionException

from specdistill.core.config import section
from specdistill.core.data.generation import GenerateConfig
from specdistill.core.data.prompts import PrepareConfig, SourceConfig
from specdistill.core.errors import ConfigError
from specdistill.core.models.target import TargetConfig

from .helpers.config import composed
from .helpers.project import ROOT

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf/experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_into_valid_sections(experiment):
    cfg = composed(f"experiment={experiment}")
    assert cfg["experiment_name"] == experiment
    section(TargetConfig, cfg["target"], "target")
    section(GenerateConfig, cfg["generate"], "generate")
    data = dict(cfg["data"])
    section(PrepareConfig, data, "data", source=section(SourceConfig, data.pop("source"), "data.source"))
    assert set(cfg["assets"]["items"]) == {"target", "sharegpt", "mtbench", "humaneval"}
    # the training sections too: a bad one must fail at start, not after the target has loaded
    from specdistill import methods
    from specdistill.core.data.datamodule import DataConfig
    from specdistill.stages.train import DistillConfig, method_sections
    from specdistill.training.base import build_optimizer
    from specdistill.training.losses import build_loss

    for key in cfg["methods"]:
        method, _, _, loss, distill = method_sections(cfg, key)
        assert method.name in methods.names("train")
        build_loss(loss.name, loss.temperature, **(loss.params or {}))
        build_optimizer(distill["optimizer"], f"methods.{key}.optimizer")
        section(DataConfig, section(DistillConfig, distill, "distill").data, "distill.data")
    from specdistill.online.policy import OnlineConfig

    section(OnlineConfig, cfg["online"], "online")
    from specdistill.stages.evaluate import EvalConfig

    section(EvalConfig, cfg["eval"], "eval")
    # every method that drafts has its decode section composed (conf/decode/<m>.yaml), checked, the EAGLE tree too
    assert set(cfg["decode"]) == {n for n, m in methods.all_methods().items() if m.decode}
    for name in cfg["decode"]:
        methods.decode_settings(cfg, name)
    for key, item in cfg["evals"].items():  # and each evaluate item's keys over its method's
        methods.decode_settings(cfg, item["method"], item.get("decode")), key
    assert cfg["trainer"]["max_steps"] > 0 and cfg["method"] in cfg["methods"]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_dspark_and_xpress_are_dflash_with_a_head_in_every_experiment(experiment):
    """The A/B of stage compare: whatever an experiment sets for methods.dflash, methods.dspark and methods.xpress
    follow (but the head, how it trains and where it starts from)."""
    methods = composed(f"experiment={experiment}")["methods"]
    differ = {k for k in methods["dflash"].keys() | methods["dspark"].keys()
              if methods["dflash"].get(k) != methods["dspark"].get(k)}
    assert differ <= {"markov_rank", "init_from"} and methods["dspark"]["markov_rank"] > 0, differ
    xpress = {k for k in methods["dflash"].keys() | methods["xpress"].keys()
              if methods["dflash"].get(k) != methods["xpress"].get(k)}  # XPress: the refiner and how it trains
    assert xpress <= {"refiner_rank", "refiner_mlp_ratio", "consistency_passes", "consistency_weight", "base_weight",
                      "init_from"} and methods["xpress"]["refiner_rank"] > 0, xpress


def test_required_experiments_exist():
    assert {"default", "cpu_full", "smoke"} <= set(EXPERIMENTS)


def test_unknown_override_key_fails_and_names_it():
    with pytest.raises(ConfigCompositionException, match="max_new_token"):
        composed("generate.max_new_token=64")


def test_unknown_key_in_a_section_names_it():
    with pytest.raises(ConfigError, match=r"\['max_new_token'\] in `generate`"):
        section(GenerateConfig, {"max_new_token": 3}, "generate")


def test_bad_values_fail_at_start():
    from specdistill.core.data.generation import GenerationError

    with pytest.raises(GenerationError, match="generate.source"):
        GenerateConfig(source="draft")
    with pytest.raises(GenerationError, match="top_p"):
        GenerateConfig(top_p=0)


def test_committed_params_yaml_is_a_composition_of_conf():
    """params.yaml is what DVC composes; a stale one would make dvc.lock lie."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert params == composed(f"experiment={params['experiment_name']}")


def test_no_runtime_resolvers_outside_conf_hydra():
    for path in (ROOT / "conf").rglob("*.yaml"):
        if "hydra" in path.relative_to(ROOT / "conf").parts:
            continue
        text = path.read_text()
        assert "${now:" not in text and "${hydra:" not in text and "${oc.env:" not in text, path


def test_stage_front_door_rejects_unknown_key():
    proc = subprocess.run([sys.executable, str(ROOT / "pipelines/generate.py"), "generate.bogus=1"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0
    assert "bogus" in proc.stderr + proc.stdout


def test_a_bad_global_is_named_as_itself_not_as_a_section_key():
    """`seed=abc` was reported as `generate.seed`, the first section key that interpolates it."""
    proc = subprocess.run([sys.executable, str(ROOT / "pipelines/generate.py"), "seed=abc"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0
    assert "`seed='abc'`: must be an integer" in proc.stderr + proc.stdout and "generate.seed" not in proc.stderr


def test_stage_help_lists_config():
    proc = subprocess.run([sys.executable, str(ROOT / "pipelines/prepare.py"), "--help"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0
    assert "experiment" in proc.stdout and "generate" in proc.stdout


def test_a_missing_params_yaml_says_how_to_compose_it(tmp_path):
    """Issue 33, item 5: DVC's way of running a stage, before `make params`, once gave Hydra's bare error."""
    proc = subprocess.run([sys.executable, str(ROOT / "pipelines/evaluate.py"), "--config-dir", ".", "--config-name",
                           "params"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "params.yaml does not exist: compose it from conf/ with `make params`" in proc.stderr


def test_stage_help_says_what_it_does_reads_and_writes():
    """Issue 31, item 5: `--help` once named the app `_entry` and dumped the 304-line config."""
    out = subprocess.run([sys.executable, str(ROOT / "pipelines/train.py"), "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.startswith("train@M: distill a draft") and "_entry" not in out
    assert "train@draft" in out and "Reads:  <inputs>" in out
    assert "Writes: models/<key>" in out and "loss         ce | fkl | jsd" in out and "--cfg job" in out
    assert len(out.splitlines()) < 60
    evaluate = subprocess.run([sys.executable, str(ROOT / "pipelines/evaluate.py"), "--help"], capture_output=True,
                              text=True, timeout=120, check=True).stdout
    writes = next(line for line in evaluate.splitlines() if line.startswith("Writes: "))
    assert "metrics/<experiment_name>/<key>.json" in writes and "$" not in writes and "{" not in writes, writes


@pytest.mark.parametrize("args", [["loss=tvd", "--cfg", "hydra"], ["--cfg", "hydra", "loss=tvd"]])
def test_overrides_before_or_after_a_flag_keep_the_stages_name(args):
    """The front door adds `hydra.job.name=<stage>` to the user's overrides: once appended after `--cfg hydra`,
    it split `loss=tvd --cfg hydra` into two runs of words that Hydra's parser refused."""
    out = subprocess.run([sys.executable, str(ROOT / "pipelines/train.py"), *args], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-500:]
    # the shorthand, as Hydra got it
    assert "    name: train\n" in out.stdout and "- loss@methods.draft.loss=tvd" in out.stdout


def test_a_local_targets_stamp_follows_its_files(tmp_path, monkeypatch):
    """target=hf with a local folder: `target.stamp` names what the folder holds when params.yaml is composed (by
    DVC's own composition, through hydra_plugins/), so weights replaced at the same path change the params every
    target-reading stage depends on. The same files elsewhere or touched (a teammate's copy), or a download's
    .cache/, leave it as it was; a hub id or a missing path has none."""
    import os
    import shutil

    from dvc.utils.hydra import compose_and_dump

    from specdistill.core.config import files_stamp

    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))  # each file's sha256, kept under its stat
    model = tmp_path / "model"
    (model / ".cache").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 64)

    def stamp(*overrides: str) -> str | None:  # as `dvc exp run` composes: plugins from the repository root
        out = tmp_path / "params.yaml"
        compose_and_dump(out, str(ROOT / "conf"), None, "config", str(ROOT), ["target=hf", *overrides])
        return yaml.safe_load(out.read_text())["target"]["stamp"]

    first = stamp(f"target.name_or_path={model}")
    assert first is not None and first.startswith("2 files:")
    assert (tmp_path / "cache/file_sha256.json").exists()
    (model / ".cache" / "lock").write_text("x")  # the hub client's bookkeeping: not the model
    st = (model / "config.json").stat()
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # touched, not changed
    assert files_stamp(str(model)) == first
    shutil.copytree(model, tmp_path / "copy")  # the same files elsewhere, new times
    assert files_stamp(str(tmp_path / "copy")) == first
    (model / "model.safetensors").write_bytes(b"\1" * 64)  # new weights, same size, same path
    changed = stamp(f"target.name_or_path={model}")
    assert changed not in (None, first)
    assert stamp("target.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct") is None
    assert files_stamp(None) is None and files_stamp("") is None  # not the current folder
    assert composed("target=hf", f"target.name_or_path={model}")["target"]["stamp"] == changed
    # no name_or_path: the stamp is null, and the missing key is the stage's to name (as before the stamp)
    assert composed("target=hf")["target"]["stamp"] is None
    # what DVC watches: every stage that loads the target lists the whole `target` section among its params
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name in ("generate", "features", "train", "evaluate", "online", "export", "serve"):
        assert "target" in stages[name].get("do", stages[name])["params"], name
