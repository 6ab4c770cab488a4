"""W&B runs are offline by default, carry the stage's group and job type, and always finish."""

from __future__ import annotations

import pytest

from specdistill.core.tracking import wandb_run


def cfg(tmp_path, **kw):
    return {"enabled": True, "project": "specdistill-test", "entity": None, "mode": "offline",
            "dir": str(tmp_path), "tags": [], **kw}


def test_offline_run_writes_files_and_finishes(tmp_path, monkeypatch):
    import wandb

    monkeypatch.delenv("WANDB_MODE", raising=False)
    with wandb_run(cfg(tmp_path), job_type="generate", group="smoke", config={"a": 1}) as run:
        run.log({"generate/tokens_per_s": 12.5})
        assert run.settings.mode == "offline"
        assert run.group == "smoke" and run.job_type == "generate" and run.config["a"] == 1
    assert wandb.run is None
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_run_is_finished_on_error(tmp_path):
    import wandb

    with pytest.raises(ValueError), wandb_run(cfg(tmp_path), job_type="x", group="g", config={}):
        raise ValueError("boom")
    assert wandb.run is None


def test_disabled_logger_is_a_no_op(tmp_path):
    with wandb_run({"enabled": False}, job_type="x", group="g", config={}) as run:
        run.log({"a": 1})
    assert not (tmp_path / "wandb").exists()


def test_a_run_is_named_after_its_stage_and_logs_a_folder_by_reference(tmp_path, monkeypatch):
    from specdistill.core.tracking import log_folder

    monkeypatch.delenv("WANDB_MODE", raising=False)
    model = tmp_path / "models/eagle"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"x" * 64)
    with wandb_run(cfg(tmp_path), job_type="export", group="smoke", config={}) as run:
        assert run.name == "export"  # the stage, where no item name is given
        log_folder(run, model, "export@eagle")
    with wandb_run(cfg(tmp_path), job_type="evaluate", name="evaluate@eagle", group="smoke", config={}) as run:
        assert run.name == "evaluate@eagle" and run.job_type == "evaluate"
    with wandb_run({"enabled": False}, job_type="x", group="g", config={}) as off:
        log_folder(off, model, "x")  # logging off: nothing to log to, no error
