"""train@draft on a tiny random target: every loss runs, metrics are exact under DDP, a killed run resumes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from specdistill.core.errors import ConfigError
from specdistill.core.records import read_record
from specdistill.stages import train as train_stage

from .helpers.data import write_split
from .helpers.project import ROOT
from .helpers.train import composed, overrides

LOSSES = ["fkl", "rkl", "jsd", "tvd", "topk_kl", "ce"]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("vocab", ["128", "null"])
def test_fast_dev_run_every_loss(tmp_path, tiny_target_dir, generated, loss, vocab):
    cfg = composed(*overrides(tmp_path, tiny_target_dir, generated, f"loss={loss}", "+trainer.fast_dev_run=2",
                              f"methods.draft.vocab_size={vocab}"))
    res = train_stage.run(cfg)
    assert res["settings"]["draft_vocab"] == (128 if vocab == "128" else None)
    assert 0 < res["final"]["val/alpha"] <= 1 and 1 <= res["final"]["val/tau_sim"] <= 5
    assert (tmp_path / "models/draft/config.json").exists()
    assert read_record(tmp_path / "metrics/train_draft.json")["settings"]["loss"]["name"] == loss


@pytest.mark.parametrize("source", ["draft", "mix"])
def test_on_policy_sources_train(tmp_path, tiny_target_dir, generated, source):
    mix = ["data.code_fraction=0.5"] if source == "mix" else []  # the prompt mix is recorded only when set
    res = train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, f"distill.data.source={source}",
                                              "distill.data.max_response_tokens=6", "+trainer.fast_dev_run=2", *mix)))
    assert res["settings"]["distill"]["data"]["source"] == source and 0 < res["final"]["val/alpha"] <= 1
    assert res["settings"].get("prompt_mix") == ({"code_fraction": 0.5} if mix else None)


@contextlib.contextmanager
def killed_at(monkeypatch, step: int):
    """A context in which the draft's training raises at `step`, as a kill would stop it there."""
    from specdistill.methods.draft.training import DraftLMModule

    def crash(self, outputs, batch, batch_idx):
        if self.global_step == step:
            raise RuntimeError("killed")

    with monkeypatch.context() as m:
        m.setattr(DraftLMModule, "on_train_batch_end", crash, raising=False)
        yield


def test_a_killed_run_resumes_its_step_count_and_curve(tmp_path, tiny_target_dir, generated, monkeypatch):
    cfg = composed(*overrides(tmp_path, tiny_target_dir, generated, "trainer.val_check_interval=6",
                              "trainer.max_steps=12", "methods.draft.optimizer.lr=3e-3", "methods.draft.init=random"))
    with killed_at(monkeypatch, 8), pytest.raises(RuntimeError, match="killed"):
        train_stage.run(cfg)
    ckpt = torch.load(tmp_path / "checkpoints/draft/last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 6 and [r["step"] for r in ckpt["val_history"]] == [6]
    assert not (tmp_path / "models/draft").exists()  # nothing half-written under the final name
    res = train_stage.run(cfg)
    assert res["steps"] == 12
    rows = (tmp_path / "plots/train_draft/val.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["6", "12"]  # the curve continues the killed run's
    assert float(rows[1].split(",")[1]) == pytest.approx(ckpt["val_history"][0]["val/alpha"])
    # the resumed epoch continues at the killed run's batch, not its first: the same weights as one run
    whole = train_stage.run(composed(*overrides(tmp_path / "whole", tiny_target_dir, generated,
                                                "trainer.val_check_interval=6", "trainer.max_steps=12",
                                                "methods.draft.optimizer.lr=3e-3", "methods.draft.init=random")))
    assert whole["final"]["val/alpha"] == pytest.approx(res["final"]["val/alpha"], rel=1e-6)
    resumed, straight = (load_file(p / "models/draft/model.safetensors") for p in (tmp_path, tmp_path / "whole"))
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    # a changed configuration does not resume a foreign checkpoint
    other = composed(*overrides(tmp_path, tiny_target_dir, generated, "trainer.val_check_interval=6",
                                "trainer.max_steps=6", "methods.draft.init=random"))
    assert train_stage.run(other)["steps"] == 6


def test_distillation_raises_alpha(tmp_path, tiny_target_dir, tiny_tokenizer):
    """Forward-KL steps through the whole stage pull the draft's distribution to the target's. Validated on
    the training sequences: two dozen random sequences teach the function, not a held-out generalisation."""
    write_split(tmp_path / "gen/train", 16, 0, len(tiny_tokenizer))
    write_split(tmp_path / "gen/val", 16, 0, len(tiny_tokenizer))
    cfg = composed(*overrides(tmp_path, tiny_target_dir, tmp_path / "gen", "trainer.val_check_interval=10",
                              "trainer.max_steps=40", "methods.draft.optimizer.lr=3e-3",
                              "methods.draft.vocab_size=null"))
    res = train_stage.run(cfg)
    rows = [r.split(",") for r in (tmp_path / "plots/train_draft/val.csv").read_text().splitlines()[1:]]
    alphas = [float(r[1]) for r in rows]
    assert alphas[-1] > alphas[0] + 0.05, alphas
    assert res["final"]["val/alpha"] == pytest.approx(alphas[-1], abs=1e-6)


@pytest.mark.parametrize("method", ["draft", "medusa"])
def test_a_method_s_own_trainer_section_wins(tmp_path, tiny_target_dir, generated, method):
    res = train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, f"method={method}",
                                              "trainer.max_steps=50", f"++methods.{method}.trainer.max_steps=2",
                                              "methods.medusa.num_heads=2", "methods.medusa.vocab_size=128")))
    assert res["steps"] == 2 and res["settings"]["trainer"]["max_steps"] == 2


@pytest.mark.parametrize(("native", "precision"), [(False, "32-true"), (True, "bf16-mixed")])
def test_auto_precision_follows_the_cpu_and_is_recorded(tmp_path, tiny_target_dir, generated, monkeypatch, native,
                                                       precision):
    """trainer.precision=auto (conf's default): bf16 autocast only where the CPU has its kernels (emulated on AVX2,
    it made a 2-layer draft's step ~45 s); the record names the precision that ran, not `auto`."""
    from specdistill.core import hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    res = train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, "trainer.precision=auto",
                                              "trainer.max_steps=1")))
    assert res["settings"]["trainer"]["precision"] == precision
    assert res["settings"]["target_dtype"] == "float32"  # the live teacher's, as loaded (tests pin float32)


def test_progress_shows_in_a_log_file(tmp_path, tiny_target_dir, generated, capfd):
    """Not a terminal (`nohup dvc repro > log`): the steps still show, as tqdm lines."""
    train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, "trainer.max_steps=3",
                                        "trainer.enable_progress_bar=true")))
    out = capfd.readouterr()
    assert "Epoch 0" in out.out + out.err and "1/3" in out.out + out.err  # every step, not only the end


def test_bad_config_fails_before_the_target_loads(tmp_path, tiny_target_dir, generated):
    with pytest.raises(ConfigError, match="loss"):
        train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, "loss=jsd",
                                            "methods.draft.loss.params.beta=1.5")))
    with pytest.raises(ConfigError, match="teacher=stored"):
        train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, "loss=tvd",
                                            "distill.teacher=stored")))
    with pytest.raises(ConfigError, match="method="):
        train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, "method=medusa3")))


def test_a_continued_run_records_its_lineage(tmp_path, tiny_target_dir, generated):
    """Each run's name, steps and prompt mix, oldest first, so a report names what a continuation stands on."""
    def run(name, *extra):
        return train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, f"distill.output={name}",
                                                   "trainer.val_check_interval=1", *extra)))
    first = run("a", "trainer.max_steps=2", "data.code_fraction=0.5")
    assert "lineage" not in first["settings"]  # a run from scratch keeps its settings as they were
    run("b", "trainer.max_steps=1", f"methods.draft.init_from={tmp_path}/models/a")
    third = run("c", "trainer.max_steps=0", f"methods.draft.init_from={tmp_path}/models/b")
    assert third["settings"]["lineage"] == [
        {"run": "a", "steps": 2, "train_tokens": first["settings"]["train_tokens"],
         "prompt_mix": {"code_fraction": 0.5}},
        {"run": "b", "steps": 1, "train_tokens": first["settings"]["train_tokens"]}]
    assert read_record(tmp_path / "metrics/train_c.json")["settings"]["lineage"][0]["run"] == "a"


def test_lineage_of_folders_saved_before_it_or_without_settings(tmp_path):
    (tmp_path / "bare").mkdir()
    assert train_stage.lineage(str(tmp_path / "bare")) == [{"run": "bare"}]
    old = tmp_path / "old"  # saved before lineage was recorded: its init_from is followed while it exists
    old.mkdir()
    settings = {"distill": {"output": "old"}, "trainer": {"max_steps": 5}, "train_tokens": 7,
                "method": {"init_from": str(tmp_path / "bare")}}
    (old / "specdistill.json").write_text(json.dumps(settings))
    assert train_stage.lineage(str(old)) == [{"run": "bare"}, {"run": "old", "steps": 5, "train_tokens": 7}]
    settings["method"]["init_from"] = "/gone/elsewhere/first"  # a folder on another machine: named only
    (old / "specdistill.json").write_text(json.dumps(settings))
    assert train_stage.lineage(str(old))[0] == {"run": "first"}


def torchrun(tmp_path, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "pipelines/train.py",
           f"hydra.run.dir={tmp_path}/hydra", "trainer=ddp", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.ddp
def test_ddp_validation_equals_one_process(tmp_path, tiny_target_dir, tiny_tokenizer, generated):
    """A fixed draft validated by 2 gloo processes (3 and 2 batches, unequal tokens) gives the 1-process numbers."""
    from transformers import AutoModelForCausalLM

    from specdistill.methods.draft.model import DraftSize, build_draft, save_draft

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    save_draft(build_draft(target, DraftSize("xs", num_layers=1), "random", seed=3).eval(), tmp_path / "fixed")
    common = [f"methods.draft.init_from={tmp_path / 'fixed'}", "trainer.max_steps=0"]
    one = train_stage.run(composed(*overrides(tmp_path / "one", tiny_target_dir, generated, *common)))["final"]
    torchrun(tmp_path, *overrides(tmp_path / "two", tiny_target_dir, generated, *common))
    two = read_record(tmp_path / "two/metrics/train_draft.json")["final"]
    keys = ["val/alpha", "val/alpha_t0", "val/tau_sim", "val/tau_sim_t0", "val/alpha_pos3", "val/loss"]
    for k in keys:
        assert two[k] == pytest.approx(one[k], abs=1e-4), k
    assert two["val/alpha"] != pytest.approx(0.5, abs=1e-3)  # a real measurement, not a default


@pytest.mark.ddp
def test_ddp_training_writes_one_checkpoint_and_one_wandb_run(tmp_path, tiny_target_dir, generated):
    torchrun(tmp_path, *overrides(tmp_path, tiny_target_dir, generated, "trainer.max_steps=4",
                                  "trainer.val_check_interval=2", "logger=wandb", f"paths.wandb_dir={tmp_path}"))
    res = read_record(tmp_path / "metrics/train_draft.json")
    assert res["steps"] == 4 and res["settings"]["trainer"]["strategy"] == "ddp"
    assert (tmp_path / "models/draft/model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints/draft").glob("*.ckpt")) == ["last.ckpt", "step4.ckpt"]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs


@pytest.mark.parametrize("method", ["draft", "medusa", "eagle"])
def test_weights_do_not_depend_on_what_the_process_drew_before(tmp_path, tiny_target_dir, generated, method):
    """A run is a function of its config and seed: Medusa's residual biases once drew from the process RNG,
    so a retrain from an empty checkout did not repeat its heads (EAGLE's and the draft's did)."""
    weights = []
    for i in range(2):
        torch.rand(3 + 4 * i)  # what other code in the process drew before
        extra = [] if method == "draft" else [f"method={method}", f"methods.{method}.vocab_size=128"]
        extra += ["methods.eagle.feature_layers=[0,1,2]"] if method == "eagle" else []  # the tiny target's 3
        train_stage.run(composed(*overrides(tmp_path / str(i), tiny_target_dir, generated, "trainer.max_steps=3",
                                            "trainer.val_check_interval=3", *extra)))
        folder = tmp_path / str(i) / "models" / method
        weights.append({k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()})
    assert weights[0].keys() == weights[1].keys() and weights[0]
    assert [k for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])] == []


def test_a_cut_off_checkpoint_falls_back_or_names_the_folder(tmp_path, tiny_target_dir, generated, monkeypatch, caplog):
    """Issue 33, item 5: a truncated last.ckpt once gave a raw PytorchStreamReader error."""
    cfg = composed(*overrides(tmp_path, tiny_target_dir, generated, "trainer.val_check_interval=3",
                              "trainer.max_steps=9", "methods.draft.init=random"))
    with killed_at(monkeypatch, 7), pytest.raises(RuntimeError, match="killed"):
        train_stage.run(cfg)
    ckpts = tmp_path / "checkpoints/draft"
    newest = (ckpts / "last.ckpt").resolve()
    older = ckpts / "step3.ckpt"
    shutil.copy(newest, older)  # as if the run died between writing step 6 and removing step 3
    os.utime(older, (1, 1))
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    assert train_stage.run(cfg)["steps"] == 9
    assert "resuming from the newest whole checkpoint" in caplog.text and "step3.ckpt" in caplog.text
    # with no whole checkpoint left: an error that says what to delete, and the damaged file kept
    with killed_at(monkeypatch, 7), pytest.raises(RuntimeError, match="killed"):
        train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, "trainer.val_check_interval=3",
                                            "trainer.max_steps=9", "methods.draft.init=random", "seed=5")))
    for p in ckpts.glob("step*.ckpt"):
        p.write_bytes(p.read_bytes()[:1000])
    with pytest.raises(ConfigError, match=rf"damaged .*Delete {ckpts}"):
        train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, "trainer.val_check_interval=3",
                                            "trainer.max_steps=9", "methods.draft.init=random", "seed=5")))


def test_every_train_item_of_dvc_yaml_is_a_method_config_and_trains(tmp_path, tiny_target_dir, generated):
    """Each train@<key> distills `methods.<key>` from `method=<key>` alone: no config in dvc.yaml. The separate
    draft's items train a step here (the heads have their own fixtures: test_medusa, test_eagle, test_dflash);
    draft_ce's data source needs the prepare stage's references, so its config is checked, not trained."""
    from .helpers.pipeline import items

    trains = {name.split("@")[1]: item for name, item in items().items() if name.startswith("train@")}
    assert all(item.cmd.endswith(f"method={key}") for key, item in trains.items())
    cfg = composed()
    assert set(trains) == set(cfg["methods"])
    for key in ("draft", "draft_full"):
        res = train_stage.run(composed(*overrides(tmp_path / key, tiny_target_dir, generated, f"method={key}",
                                                  "+trainer.fast_dev_run=1")))
        assert res["steps"] >= 1 and res["method"] == "draft", key
    assert cfg["methods"]["draft_full"]["vocab_size"] is None
    ce = cfg["methods"]["draft_ce"]
    assert (ce["name"], ce["loss"]["name"], ce["data"]) == ("draft", "ce", {"source": "dataset"})
    assert cfg["methods"]["eagle31"]["fc_norm"] and cfg["methods"]["eagle31"]["norm_output"]
