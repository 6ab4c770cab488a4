"""Sweeps through submitit (docs/cluster.md): a real multirun of the train front door on the local executor
(the SLURM launcher's code path: the sweep pickled, each job run in its own process), and what the SLURM
launcher config (`hydra/launcher=slurm`) asks the cluster for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specdistill.core.records import read_record

from .helpers.data import write_split
from .helpers.project import ROOT
from .helpers.train import overrides

LOSSES = ("fkl", "tvd")


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("generated")
    write_split(d / "train", 12, 0, len(tiny_tokenizer))
    write_split(d / "val", 4, 1, len(tiny_tokenizer))
    (d / "FINGERPRINT").write_text("tiny\n")
    return d


@pytest.mark.launcher
def test_sweep_runs_each_job_in_its_own_submitit_process(tmp_path, tiny_target_dir, generated):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "pipelines/train.py", "-m", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}",
           "hydra.launcher.timeout_min=8", f"loss={','.join(LOSSES)}", "+trainer.fast_dev_run=2",
           *overrides(tmp_path, tiny_target_dir, generated)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    # the submitit launcher ran the sweep, not Hydra's basic one
    assert "Submitit 'local' sweep output dir" in out + err

    job_ids = {}
    for num, loss in enumerate(LOSSES):
        job = sweep / str(num)
        assert f"loss@methods.draft.loss={loss}" in yaml.safe_load((job / ".hydra/overrides.yaml").read_text())
        # submitit's id of the job: the pid of the process the local executor started for it (Hydra's basic
        # launcher would leave the job number here)
        job_id = str(yaml.safe_load((job / ".hydra/hydra.yaml").read_text())["hydra"]["job"]["id"])
        assert job_id.isdigit() and int(job_id) not in (proc.pid, os.getpid()), job_id
        job_ids[loss] = job_id
        folder = sweep / ".submitit" / job_id
        assert (folder / f"{job_id}_0_result.pkl").exists(), sorted(p.name for p in folder.iterdir())
        # the job's own training ran in that process: its log is in that process's output
        log = (folder / f"{job_id}_0_log.err").read_text() + (folder / f"{job_id}_0_log.out").read_text()
        assert f"loss={loss}: val/alpha" in log, log[-3000:]
        assert all(f"loss={other}: val/alpha" not in log for other in LOSSES if other != loss)
        # and wrote its outputs: the model in its job folder, the metrics named by its loss
        assert (job / "model/config.json").exists()
        metrics = list((tmp_path / "metrics/sweep").glob(f"draft-loss={loss}.json"))  # named by the swept override
        assert len(metrics) == 1, metrics
        assert read_record(metrics[0])["settings"]["loss"]["name"] == loss
    assert len(set(job_ids.values())) == len(LOSSES), job_ids


@pytest.mark.launcher
def test_a_sweep_over_any_key_keeps_each_jobs_metrics_and_run_apart(tmp_path, tiny_target_dir, generated):
    """`-m methods.draft.optimizer.lr=a,b`: a key that is neither the method, the draft nor the loss still names each
    job's metrics file and W&B run (two jobs used to write one `draft-xs-fkl.json` and two runs of that name)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "pipelines/train.py", "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}",
           "methods.draft.optimizer.lr=1e-4,1e-3", "+trainer.fast_dev_run=1",
           *overrides(tmp_path, tiny_target_dir, generated)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    files = sorted(p.name for p in (tmp_path / "metrics/sweep").glob("*.json"))
    # Hydra hands each job the swept value as it parsed it (1e-4 -> 0.0001)
    assert files == ["draft-methods.draft.optimizer.lr=0.0001.json",
                     "draft-methods.draft.optimizer.lr=0.001.json"], files
    lrs = {read_record(tmp_path / "metrics/sweep" / f)["settings"]["distill"]["optimizer"]["lr"] for f in files}
    assert lrs == {1e-4, 1e-3}
    # the W&B run takes the job's name (Plan.run_name, which the stage logs with its result; fast_dev_run turns
    # Lightning's loggers off, so no run is written here)
    for lr in ("0.0001", "0.001"):
        assert f"draft-methods.draft.optimizer.lr={lr}: val/alpha" in proc.stdout + proc.stderr


def slurm_script(tmp_path: Path, monkeypatch, *ovr: str) -> str:
    """The sbatch script the SLURM launcher would submit for the composed config (built by submitit as the
    launcher builds it, with a stand-in `srun` on PATH: nothing is submitted)."""
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir(parents=True)
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{srun.parent}{os.pathsep}{os.environ['PATH']}")
    before = HydraConfig.instance().cfg
    try:  # `${hydra:runtime.cwd}` resolves against the current Hydra config, as in a launch
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=["hydra/launcher=slurm", *ovr], return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            params = dict(instantiate(cfg.hydra.launcher).params)  # resolved as the launcher resolves them
    finally:  # no Hydra config left behind for the tests that run after this one in the process
        HydraConfig.instance().cfg = before
    executor = submitit.AutoExecutor(cluster="slurm", folder=tmp_path / "submitit",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    params.pop("submitit_folder")
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    return executor._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")


def test_slurm_launcher_sizes_the_job_from_the_methods_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_PARTITION", "h100")
    one = slurm_script(tmp_path / "one", monkeypatch, "trainer=gpu")
    assert "#SBATCH --gpus-per-node=1\n" in one and "#SBATCH --ntasks-per-node=1\n" in one
    assert "#SBATCH --partition=h100\n" in one and "#SBATCH --cpus-per-task=8\n" in one
    assert "#SBATCH --mem-per-cpu=8G\n" in one and "#SBATCH --time=360\n" in one
    assert f"source {ROOT}/.venv/bin/activate\n" in one
    # the 8-GPU recipe: one task per device (Lightning's SLURM environment requires it), a GPU each
    node = slurm_script(tmp_path / "node", monkeypatch, "experiment=gpu_llama3_8b")
    assert "#SBATCH --gpus-per-node=8\n" in node and "#SBATCH --ntasks-per-node=8\n" in node
    # a method's own trainer wins over `trainer`, as in train.py
    medusa = slurm_script(tmp_path / "medusa", monkeypatch, "trainer=fsdp", "method=medusa",
                          "++methods.medusa.trainer.devices=4")
    assert "#SBATCH --gpus-per-node=4\n" in medusa and "#SBATCH --ntasks-per-node=4\n" in medusa
    monkeypatch.delenv("SLURM_PARTITION")
    assert "--partition" not in slurm_script(tmp_path / "nopart", monkeypatch, "trainer=gpu")
