"""No config value deletes what a stage did not write (issue: hardening, item 1).

Each value that once deleted the checkout runs here against a temporary copy of the project, through the real
config and the real stage: it must be refused at start, with the key named, and leave every file (`.git` and
`data/` included) byte-identical.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specdistill.core.io import atomic_path
from specdistill.core.outputs import MARKER, OutputError, check_paths, check_replaceable, plain_name

from .helpers.checkout import composed, snapshot, stage_run

DELETING = [  # (stage, overrides, the key the error must name): each of these once emptied the checkout
    ("evaluate", ["eval.name=.."], "eval.name"),
    ("evaluate", ["eval.name=../../escaped"], "eval.name"),
    ("train", ["method=draft", "distill.output=.."], "distill.output"),
    ("report", ["paths.reports_dir=."], "paths.reports_dir"),
    ("report", ["experiment_name=.."], "experiment_name"),
    ("generate", ["paths.generated_dir=data"], "paths.generated_dir"),  # would hold (and wipe) data/prompts
    ("generate", ["paths.generated_dir=models"], "paths.generated_dir"),  # exists, not ours: no FINGERPRINT
    ("train", ["method=draft", "paths.checkpoints_dir=data", "distill.output=prompts"], "paths.checkpoints_dir"),
    ("evaluate", ["paths.plots_dir=data", "eval.name=prompts"], "paths.plots_dir"),  # holds data/prompts
    # second round: a derived folder (plots/<eval.name>, models/<distill.output>, a report) inside another output
    ("report", ["paths.reports_dir=models/draft"], "paths.models_dir"),  # the trained draft replaced by the report
    ("evaluate", ["paths.plots_dir=models"], "paths.models_dir"),  # measured models/draft, then replaced it
    ("evaluate", ["paths.plots_dir=data/prompts", "eval.name=train"], "paths.plots_dir"),
    ("train", ["method=draft", "paths.models_dir=data/prompts", "distill.output=train"], "paths.models_dir"),
    ("evaluate", ["paths.metrics_dir=models/draft", "eval.name=config"], "paths.models_dir"),  # its config.json
    ("evaluate", ["eval.name=" + "x" * 300], "eval.name"),  # once a raw `OSError: File name too long`
    ("online", ["paths.models_dir=/"], "paths.models_dir"),
]


@pytest.mark.parametrize("stage,overrides,key", DELETING, ids=[" ".join(o) for _, o, _ in DELETING])
def test_a_deleting_value_is_refused_at_start_and_the_checkout_is_untouched(checkout, stage, overrides, key):
    outside = checkout.parents[2]
    before, before_outside = snapshot(checkout), snapshot(outside)
    cfg = composed(checkout, *overrides)
    with pytest.raises(OutputError, match=f"`{key}"):
        stage_run(stage)(cfg)
    assert snapshot(checkout) == before
    assert snapshot(outside) == before_outside  # nothing written above the project either


def test_the_front_door_refuses_before_it_loads_anything(checkout):
    before = snapshot(checkout)
    res = subprocess.run([sys.executable, "pipelines/report.py", "paths.reports_dir=.", "logger=none"],
                         cwd=checkout, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    assert res.returncode != 0 and "OutputError" in res.stderr and "paths.reports_dir=." in res.stderr
    after = snapshot(checkout)
    assert {k: v for k, v in after.items() if k in before} == before
    assert all(k.startswith(("outputs/", "__pycache__/")) or "/__pycache__/" in k for k in set(after) - set(before))


@pytest.mark.parametrize("value", ["..", ".", "../x", "a/b", "", ".hidden", "/abs", None, 3, "x" * 300])
def test_names_that_become_paths_are_plain(value):
    with pytest.raises(OutputError, match="plain name"):
        plain_name(value, "eval.name")


@pytest.mark.parametrize("value", ["eagle", "eagle_lookup", "draft-xs-fkl", "lr=1e-3,bs=8", "v1.2"])
def test_plain_names_pass(value):
    assert plain_name(value, "eval.name") == value


def test_paths_that_hold_the_project_or_another_output_are_refused(tmp_path):
    ok = {"prompts_dir": "data/prompts", "generated_dir": "data/generated", "reports_dir": "reports/x",
          "wandb_dir": "."}  # W&B writes its own wandb/ below wandb_dir
    check_paths(ok, root=tmp_path)
    check_paths({**ok, "generated_dir": str(tmp_path.parent / "elsewhere")}, root=tmp_path)  # outside: fine
    for bad in ({"reports_dir": "."}, {"models_dir": ".."}, {"metrics_dir": str(tmp_path)},
                {"generated_dir": "data"}, {"reports_dir": "data/prompts/.."}):
        with pytest.raises(OutputError):
            check_paths({**ok, **bad}, root=tmp_path)


def test_a_stage_replaces_only_folders_it_wrote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with atomic_path("out", is_dir=True) as tmp:
        (tmp / "a").write_text("1")
    assert (tmp_path / "out" / MARKER).is_file()
    with atomic_path("out", is_dir=True) as tmp:  # its own: replaced whole
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [MARKER, "b"]
    (tmp_path / "mine" / "sub").mkdir(parents=True)
    (tmp_path / "mine" / "sub" / "keep.txt").write_text("user's")
    with pytest.raises(OutputError, match="not written by this stage"):
        with atomic_path("mine", is_dir=True) as tmp:
            raise AssertionError("refused before the work starts")
    assert (tmp_path / "mine" / "sub" / "keep.txt").read_text() == "user's"
    assert not list(tmp_path.glob(".mine.tmp-*"))
    (tmp_path / "empty").mkdir()
    with atomic_path("empty", is_dir=True) as tmp:  # an empty folder holds nothing to lose
        (tmp / "c").write_text("3")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match="not a folder"):
        check_replaceable(tmp_path / "afile", "eval.name")
    os.symlink(tmp_path / "mine", tmp_path / "link")  # a link to a folder of the user's: never followed
    with pytest.raises(OutputError):
        check_replaceable(tmp_path / "link", "eval.name")


def test_a_folder_that_appears_while_the_stage_runs_is_not_deleted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError):
        with atomic_path("late", is_dir=True) as tmp:
            (tmp / "a").write_text("1")
            (tmp_path / "late").mkdir()
            (tmp_path / "late" / "user.txt").write_text("keep")
    assert (tmp_path / "late" / "user.txt").read_text() == "keep"


@pytest.mark.parametrize("var", ["RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID"])
def test_a_process_any_launcher_names_as_another_rank_is_not_rank_zero(var, monkeypatch):
    """srun sets only SLURM_PROCID / SLURM_LOCALID: every rank of an sbatch job once took itself for rank zero, and
    the second stopped at the output lock ("another run is writing")."""
    from specdistill.core.outputs import RANK_VARIABLES, is_rank_zero

    for v in RANK_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    assert is_rank_zero()
    monkeypatch.setenv(var, "1")
    assert not is_rank_zero()


def _fresh_locks(monkeypatch, tmp_path):
    import tempfile

    from specdistill.core import outputs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(outputs, "_held", {})
    for v in outputs.RANK_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    return outputs


def test_a_link_planted_as_the_lock_is_refused_and_its_target_untouched(tmp_path, monkeypatch):
    """The lock once followed a planted symlink and truncated its target to `pid N` (issue: hardening, 2nd round)."""
    import hashlib

    outputs = _fresh_locks(monkeypatch, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("x" * 1900)
    out = (tmp_path / "models" / "draft").resolve()
    folder = outputs.lock_folder()
    (folder / f"{hashlib.sha1(str(out).encode()).hexdigest()}.lock").symlink_to(victim)
    with pytest.raises(OutputError, match="lock file"):
        outputs.lock_output(out, "distill.output")
    assert victim.read_text() == "x" * 1900


def test_the_lock_folder_is_the_users_own(tmp_path, monkeypatch):
    """Per user and 0700: a shared 0755 folder made by whoever came first locked every other user out; a folder
    others can write (or a link) is refused, naming it."""
    import stat

    outputs = _fresh_locks(monkeypatch, tmp_path)
    outputs.lock_output(tmp_path / "out", "paths.generated_dir")
    folder = outputs.lock_folder()
    assert folder.name == f"specdistill-locks-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert [p.read_text() for p in folder.iterdir()] == [f"pid {os.getpid()}\n"]
    folder.chmod(0o777)
    with pytest.raises(OutputError, match="only you can write"):
        outputs.lock_folder()
    folder.chmod(0o700)
    other = tmp_path / "elsewhere"
    other.mkdir(mode=0o700)
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    folder.symlink_to(other)
    with pytest.raises(OutputError, match="only you can write"):
        outputs.lock_output(tmp_path / "out2", "paths.generated_dir")


def test_a_run_of_another_experiment_keeps_a_committed_report(checkout):
    """A smoke run with `paths.reports_dir=reports/cpu_full` once replaced that experiment's committed report: the
    real report stage, in a copy of the checkout, is refused and every file stays byte-identical."""
    import shutil

    from .helpers.project import ROOT

    shutil.copytree(ROOT / "reports/cpu_full", checkout / "reports/cpu_full")  # as committed, its marker too
    before = snapshot(checkout)
    cfg = composed(checkout, "experiment=smoke", "paths.reports_dir=reports/cpu_full")
    with pytest.raises(OutputError, match=r"reports/cpu_full .*experiment cpu_full.*experiment smoke"):
        stage_run("report")(cfg)
    assert snapshot(checkout) == before


def test_a_folder_another_output_wrote_is_refused_naming_both(tmp_path, monkeypatch):
    """The marker names the output that wrote the folder (and a report its experiment): a smoke run with
    `paths.reports_dir=reports/cpu_full` once replaced another experiment's committed report, and any stage could
    replace a folder any other had marked. The same output rerun still replaces its own."""
    from pathlib import Path

    from specdistill.core import outputs
    from specdistill.core.stage import check_outputs

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(outputs, "_claims", {})

    def write(cfg, key, folder, text):
        check_outputs(cfg, replaced={key: Path(folder)})
        with atomic_path(folder, is_dir=True) as tmp:
            (tmp / "README.md").write_text(text)

    full = {"experiment_name": "cpu_full", "paths": {"reports_dir": "reports/cpu_full"}}
    write(full, "paths.reports_dir", "reports/cpu_full", "first")
    write(full, "paths.reports_dir", "reports/cpu_full", "committed")  # its own output: replaced
    assert "paths.reports_dir of experiment cpu_full" in (tmp_path / "reports/cpu_full" / MARKER).read_text()
    smoke = {"experiment_name": "smoke", "paths": {"reports_dir": "reports/cpu_full"}}
    with pytest.raises(OutputError, match=r"another output \(paths.reports_dir of experiment cpu_full\).*"
                                          r"this run writes paths.reports_dir of experiment smoke"):
        write(smoke, "paths.reports_dir", "reports/cpu_full", "smoke")
    assert (tmp_path / "reports/cpu_full/README.md").read_text() == "committed"
    # a model folder the online stage wrote is not the train stage's to replace (distill.output=online_draft)
    write({"paths": {}}, "online.method", "models/online_draft", "online")
    with pytest.raises(OutputError, match=r"another output \(online.method\).*writes distill.output"):
        write({"paths": {}}, "distill.output", "models/online_draft", "train")
    assert (tmp_path / "models/online_draft/README.md").read_text() == "online"
    # a folder marked before owners were named is replaced as before
    old = tmp_path / "models/old"
    old.mkdir()
    (old / MARKER).write_text(outputs.MARKER_TEXT)
    write({"paths": {}}, "distill.output", "models/old", "new")
    assert (old / "README.md").read_text() == "new"


INPUT_IN_AN_OUTPUT = [  # a derived output folder over what the same run reads: measured, then replaced
    ("evaluate", ["decode.draft.path=plots/default/draft"], "decode.draft.path"),
    ("online", ["online.method=draft", "online.items.draft=models/online_draft"], "online.items.draft"),
    ("train", ["method=draft", "methods.draft.init_from=models/draft"], "methods.draft.init_from"),
]


@pytest.mark.parametrize("stage,overrides,key", INPUT_IN_AN_OUTPUT, ids=[" ".join(o) for _, o, _ in INPUT_IN_AN_OUTPUT])
def test_a_stage_never_replaces_what_it_reads(checkout, stage, overrides, key):
    from specdistill.core import outputs

    for folder in ("models/draft", "models/online_draft", "plots/default/draft"):
        (checkout / folder).mkdir(parents=True, exist_ok=True)
        (checkout / folder / MARKER).write_text(outputs.MARKER_TEXT)  # any stage's: the inputs check refuses
        (checkout / folder / "config.json").write_text("{}")
    before = snapshot(checkout)
    with pytest.raises(OutputError, match=rf"replace what it reads.*`{key}`|`{key}=.*reads"):
        stage_run(stage)(composed(checkout, *overrides))
    assert snapshot(checkout) == before
